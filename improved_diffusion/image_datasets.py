"""Image-folder (and latent-folder) datasets and a resumable, rank-sharded sample order.

A --data_dir holds images (.png, .jpg, .jpeg, .gif) or precomputed latents (.npy / .npz, one
float array [C, H, W] per image, e.g. VAE latents for DiT; datasets/README.md says how to make
them), never both. With --class_cond True a file's class is its top folder's name when every
file lies in one of at least two subfolders (one folder per class, DIR/cat/*.png, torchvision's
ImageFolder), else its base name before the first "_" (upstream's rule); see `class_labels`. A
resume checks the folder's classes against the checkpoint's (--class_map, `resumed_class_names`).

The order in which samples are visited is a pure function of (seed, epoch, global index): the
global position p (samples consumed by all ranks together since the start of the run) lies in
epoch p // n at offset p % n of that epoch's permutation. Every step consumes one *global* batch
of `batch_size * world_size` consecutive positions and rank r takes the slice
[r * batch_size, (r + 1) * batch_size) of it. Because the position is global, a run saved on one
number of ranks resumes on any other and continues at the same place: within an epoch no sample
is visited twice or skipped.
"""
import hashlib
import io
import json
import os
import warnings
import zipfile

import numpy as np
import torch as th
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from . import dist_util, loader_workers
from .infra import preemption
from .infra import storage as bf  # blobfile's names: local paths and s3://, gs://, az://
from .infra.errors import UserError

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "gif")
LATENT_EXTENSIONS = ("npy", "npz")


class DataError(UserError):
    """The data directory is missing, empty, or holds unusable files (one-line message)."""


def list_image_files(data_dir, extensions=IMAGE_EXTENSIONS, _above=()):
    """
    All image files under `data_dir`, recursively, sorted.

    :param data_dir: a local path or an object-store URL (ckpt/storage.py).
    :param extensions: the file extensions to list (any case); LATENT_EXTENSIONS lists latents.
    :return: a sorted list of paths with extension jpg, jpeg, png or gif (any case).
    :raises DataError: (local folders) a symbolic link back to a folder above it (a loop, which
        was walked until the OS gave up), a file link whose target is missing or a loop, a
        folder that cannot be listed: one line naming it.
    """
    local = "://" not in str(data_dir)
    if local:
        real = os.path.realpath(data_dir)
        if real in _above:
            raise DataError(f"{data_dir}: a symbolic link back to {real}, a folder above it (a "
                            f"loop); remove the link or point it outside the data folder")
        _above = (*_above, real)
    try:
        entries = sorted(os.listdir(data_dir) if local else bf.listdir(data_dir))
    except OSError as e:
        raise DataError(f"cannot list {data_dir}: {e.strerror or e}; fix it or leave it out of "
                        f"the data folder") from None
    results = []
    for entry in entries:
        full_path = bf.join(data_dir, entry)
        ext = entry.split(".")[-1]
        if "." in entry and ext.lower() in extensions:
            if local and not os.path.exists(full_path):
                raise DataError(f"{full_path}: a symbolic link to nothing (its target is "
                                f"missing, or a loop); remove it or point it at the file")
            results.append(full_path)
        elif bf.isdir(full_path):
            results.extend(list_image_files(full_path, extensions, _above))
    return sorted(results)


def list_data_files(data_dir):
    """(kind, paths) of a data folder: ("images", image files) or ("latents", .npy/.npz files),
    sorted, recursively; ("images", []) when it holds neither.

    :raises DataError: when the folder holds both images and latents.
    """
    images = list_image_files(data_dir)
    latents = list_image_files(data_dir, LATENT_EXTENSIONS)
    if images and latents:
        raise DataError(
            f"--data_dir {data_dir} holds both images ({len(images)}, e.g. {images[0]}) and "
            f"latents ({len(latents)}, e.g. {latents[0]}); give a folder of one kind")
    return ("latents", latents) if latents else ("images", images)


def class_names_from_paths(paths):
    """
    Class name of each file: the part of its base name before the first "_" (as upstream).

    :return: (names: list[str] per path, mapping: dict name -> index over sorted unique names).
    """
    names = [bf.basename(p).split("_")[0] for p in paths]
    mapping = {x: i for i, x in enumerate(sorted(set(names)))}
    return names, mapping


# How a class-conditional folder names its classes (class_labels' rules), as the log says it.
CLASS_RULES = {"folders": "one folder per class (DIR/CLASS/...)",
               "prefix": "the file-name prefix before the first '_'"}


def class_labels(data_dir, paths):
    """
    The classes of the files ``paths`` under ``data_dir`` (--class_cond True), by one of two
    rules: "folders" when every file lies in a subfolder and there are at least two of them (the
    class is the top folder's name: DIR/cat/*.png, torchvision's ImageFolder), "prefix" (the
    base name before the first "_", upstream's rule: DIR/cat_001.png) otherwise, or when the
    folders are one class and every file name has a prefix. Class indices follow the names in
    ``sorted()`` order (code points: "Zebra" before "ant"), as torchvision's ImageFolder.

    :return: (rule, names: sorted class names, labels: the index of each path's class).
    :raises DataError: as many classes as files (more than one): no rule found a class shared
        by two files (names without "_", each its own class, were taken silently before);
        subfolders and file-name prefixes that name different classes (DIR/train/cat_1.png,
        DIR/test/dog_2.png), where either reading could be meant; files beside the class
        folders of a folder-per-class tree (DIR/IMG_1.jpg next to DIR/cat/, DIR/dog/), which
        would switch the whole tree to the prefix rule (unless every file has a prefix and the
        folders' files agree with it: then the prefix rule reads them all).
    """
    prefixes = class_names_from_paths(paths)[0]
    tops = [_relative(p, data_dir).split("/") for p in paths]
    nested = [i for i, t in enumerate(tops) if len(t) > 1]  # the files in subfolders
    classes = [tops[i][0] for i in nested]
    folders = classes if len(nested) == len(paths) else None
    all_prefixed = all("_" in bf.basename(p) for p in paths)
    show = lambda xs: ", ".join(sorted(set(xs))[:4]) + (", ..." if len(set(xs)) > 4 else "")
    if folders is None and len(set(classes)) >= 2 and not (
            all_prefixed and _same_partition(classes, [prefixes[i] for i in nested])):
        stray = ["/".join(t) for t in tops if len(t) == 1]
        raise DataError(
            f"--data_dir {data_dir}: --class_cond True: {len(stray)} file(s) lie beside its "
            f"class folders ({show(classes)}), in no class folder: {show(stray)}; move them "
            "into their class's folder or out of --data_dir")
    if folders is None or len(set(folders)) < 2:
        rule, per_file = "prefix", prefixes
    elif _same_partition(folders, prefixes) or not all_prefixed or len(set(prefixes)) < 2:
        rule, per_file = "folders", folders
    else:
        raise DataError(
            f"--data_dir {data_dir}: --class_cond True: its subfolders ({show(folders)}) and its "
            f"file-name prefixes ({show(prefixes)}) name different classes; pass a --data_dir "
            "of one folder per class, or one of CLASS_*.png files")
    names = sorted(set(per_file))
    if len(paths) > 1 and len(names) == len(paths):
        raise DataError(
            f"--data_dir {data_dir}: --class_cond True finds {len(names)} classes for "
            f"{len(paths)} files by {CLASS_RULES[rule]}, one class per file; put each class in "
            "its own folder (DIR/cat/*.png) or name the files CLASS_anything.png")
    index = {x: i for i, x in enumerate(names)}
    return rule, names, [index[x] for x in per_file]


def _same_partition(a, b):
    """Whether two labellings of the same files group them alike (names aside)."""
    return len(set(a)) == len(set(b)) == len(set(zip(a, b)))


def describe_classes(rule, names, limit=20):
    """One log line: the rule and the class names in label order ("0=cat 1=dog ...")."""
    shown = " ".join(f"{i}={x}" for i, x in enumerate(names[:limit]))
    more = f" ... ({len(names)} in all)" if len(names) > limit else ""
    return f"class labels from {CLASS_RULES[rule]}: {len(names)} classes: {shown}{more}"


def folder_class_names(data_dir):
    """The sorted class names of an image folder (`class_labels`' rules); [] for a missing or
    empty folder (load_data says what is wrong with it).

    :raises DataError: a folder whose every file is its own class (`class_labels`).
    """
    if not data_dir or not bf.exists(data_dir) or not bf.isdir(data_dir):
        return []
    paths = list_data_files(data_dir)[1]
    return class_labels(data_dir, paths)[1] if paths else []


def resolve_num_classes(data_dir, num_classes, log=print, who="--class_cond True",
                        flag="num_classes"):
    """
    --num_classes of a class-conditional model: ``num_classes`` when given (not None), else the
    number of class names in ``data_dir``, counted on rank 0 (``log`` says so, once, as ``who``
    sets ``flag``) and the same on every rank. A folder without images keeps upstream's default
    (1000) and load_data then explains the folder's problem.

    Collective: call from all ranks with the same arguments.
    """
    if num_classes is not None:
        return num_classes
    from .script_util import NUM_CLASSES

    names = dist_util.run_on_rank0(lambda: folder_class_names(data_dir))
    if not names:
        return NUM_CLASSES
    shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
    log(f"{who}: {len(names)} classes in --data_dir {data_dir} ({shown}); "
        f"{flag}={len(names)} (stored in the checkpoints' flags)")
    return len(names)


# --class_map: how the classes of a resume's --data_dir meet the class names its checkpoint
# stores (train.py's "class_names", in label order); `resumed_class_names`.
CLASS_MAPS = {
    "check": "refuse a resume whose classes differ from the checkpoint's (removed, added, "
             "renamed, relabelled), naming the differences",
    "keep": "the checkpoint's labels, matched by class name; a class new to it takes the next "
            "free label (room in --num_classes); its classes without images are not trained",
    "data": "the folder's own labels (0..K-1 in sorted order), as a fresh start would take; "
            "the checkpoint's names are replaced (fine-tuning on other classes)",
}


def resumed_class_names(saved, names, class_map="check", *, data_dir, source, num_classes=None,
                        flag="--class_map", num_classes_flag="--num_classes"):
    """
    The class names a resumed run trains with, in label order (label i is the i-th name), when
    the classes of its --data_dir (``names``: sorted, the labels `class_labels` gives) meet the
    class names its checkpoint stores (``saved``, in label order; None for a file that stores
    none: an older or upstream file). A pure function of its arguments: call it on every rank
    with the same values and every rank decides alike.

    ``class_map`` (CLASS_MAPS): "check" returns ``names`` when they equal ``saved`` (or nothing
    is stored) and refuses any difference; "keep" returns ``saved`` plus the folder's classes
    new to it (sorted), each keeping its label by name; "data" returns ``names``.

    :param data_dir, source: the folder and the checkpoint file, for the messages.
    :param num_classes: the model's class count (its flag: ``num_classes_flag``): "keep"
        needing more labels is refused.
    :return: (label names, note: a line for the log, or "").
    :raises DataError: one line naming the differences and the --class_map that maps them.
    """
    if class_map not in CLASS_MAPS:  # the flag's value is checked where it is parsed
        raise ValueError(f"class_map must be one of {', '.join(CLASS_MAPS)}, got {class_map!r}")
    names = [str(n) for n in names]
    if not (isinstance(saved, (list, tuple)) and saved and all(isinstance(n, str) for n in saved)):
        if class_map == "keep":
            raise DataError(f"{flag} keep: the checkpoint {source} stores no class names to keep "
                            f"(an older or upstream file); leave {flag} out to take the labels of "
                            f"--data_dir {data_dir}")
        return names, ""
    saved = list(saved)
    if names == saved:
        return names, ""
    shown = lambda xs: ", ".join(xs[:5]) + (f", ... ({len(xs)} in all)" if len(xs) > 5 else "")
    labels = lambda xs: " ".join(f"{i}={x}" for i, x in enumerate(xs[:8])) + (
        f" ... ({len(xs)} in all)" if len(xs) > 8 else "")
    if class_map == "data":
        return names, (f"{flag} data: the labels of --data_dir {data_dir} ({labels(names)}) "
                       f"replace the checkpoint's ({labels(saved)})")
    gone = [n for n in saved if n not in names]
    new = [n for n in names if n not in saved]
    if class_map == "keep":
        label_names = saved + new
        if num_classes is not None and len(label_names) > num_classes:
            raise DataError(
                f"{flag} keep: the checkpoint's {len(saved)} classes and the {len(new)} new in "
                f"--data_dir {data_dir} ({shown(new)}) need {len(label_names)} labels, but the "
                f"model has {num_classes_flag} {num_classes}; pass {num_classes_flag} "
                f"{len(label_names)} --allow_model_change True to grow it")
        untrained = f"; not in --data_dir, not trained: {shown(gone)}" if gone else ""
        again = ("" if label_names == names else
                 f" (not the folder's own labels: its later resumes take {flag} keep too)")
        return label_names, (f"{flag} keep: labels by name, as the checkpoint's: "
                             f"{labels(label_names)}{untrained}{again}")
    moved = [f"{n} {saved.index(n)}->{i}" for i, n in enumerate(names)
             if n in saved and saved.index(n) != i]
    diffs = ([f"not in --data_dir: {shown(gone)}"] if gone else []) + (
        [f"new: {shown(new)}"] if new else []) + (
        [f"labels changed: {shown(moved)}"] if moved else []) or ["another order"]
    raise DataError(
        f"--data_dir {data_dir}: its classes differ from those {source} was trained on "
        f"({labels(saved)}): {'; '.join(diffs)}; pass {flag} keep to keep the checkpoint's "
        f"labels by name, or {flag} data to take the folder's ({labels(names)})")


def relabel(loader, label_names):
    """Give the files of a class-conditional ``loader`` (load_data's) the labels of
    ``label_names`` (label i is the i-th name; every class of the loader among them), by class
    name, and make them its ``class_names``. Before the first batch (a resume)."""
    old = list(loader.class_names)
    if old == list(label_names):
        return
    index = {n: i for i, n in enumerate(label_names)}
    to_new = [index[n] for n in old]
    loader.dataset.local_classes = [to_new[c] for c in loader.dataset.local_classes]
    loader.class_names = list(label_names)
    loader.close()  # workers started with the old labels (none before the first batch)


def match_resumed_classes(loader, resuming, class_map, num_classes=None):
    """A class-conditional resume of ``loader`` (load_data's; nothing for data without class
    names): its folder's classes meet the class names the resumed model file stores
    (``resuming``: the checkpointer's Resume) as ``class_map`` says (resumed_class_names: a
    difference stops the run with one line naming it unless mapped); the loader is relabelled
    to the names trained with. Returns (those names, a note to log or None), or None. Every rank
    decides alike: the same file, the same data (its fingerprint was compared)."""
    names = getattr(loader, "class_names", None)
    if not names:
        return None
    raw = resuming.model_file.raw
    label_names, note = resumed_class_names(
        raw.get("class_names") if isinstance(raw, dict) else None, names, class_map,
        data_dir=getattr(getattr(loader, "dataset", None), "root", None),
        source=str(resuming.plan.model), num_classes=num_classes)
    relabel(loader, label_names)
    return label_names, note


class _FileDataset(Dataset):
    """A dataset of one file per sample (images or latents), with optional class labels and a
    cheap content fingerprint. Subclasses load one file in ``__getitem__``.

    :param resolution: output side length H = W.
    :param image_paths: list of file paths.
    :param classes: optional list of int class indices, one per path.
    :param root: the folder the paths were listed from (names in `fingerprint()` are relative
        to it); default: the paths' common folder.
    """

    def __init__(self, resolution, image_paths, classes=None, root=None):
        super().__init__()
        if classes is not None and len(classes) != len(image_paths):
            raise ValueError(
                f"got {len(classes)} class labels for {len(image_paths)} images; give one per image"
            )
        self.resolution = resolution
        self.local_images = list(image_paths)
        self.local_classes = None if classes is None else [int(c) for c in classes]
        self.root = root
        self._fingerprint = None

    def fingerprint(self):
        """
        What identifies this dataset's content cheaply: no image bytes are read, one stat per file.

        Two folders with the same files (relative path and size) give the same fingerprint wherever
        they are mounted, so ranks with local copies of a dataset can be compared.

        :return: {"num_files": int, "sha256": hex str of the sorted (relative path, size) list}.
        """
        if self._fingerprint is None:
            paths = [str(p) for p in self.local_images]
            root = str(self.root) if self.root else (
                os.path.commonpath([os.path.dirname(p) for p in paths]) if paths else "")
            h = hashlib.sha256()
            for rel, path in sorted((_relative(p, root), p) for p in paths):
                h.update(f"{rel}\0{bf.stat(path).size}\n".encode("utf-8", "surrogateescape"))
            self._fingerprint = {"num_files": len(paths), "sha256": h.hexdigest()}
        return dict(self._fingerprint)

    def __len__(self):
        return len(self.local_images)

    def _cond(self, idx):
        """{"y": np.int64 scalar} for a labelled dataset, else {}."""
        if self.local_classes is None:
            return {}
        return {"y": np.array(self.local_classes[idx], dtype=np.int64)}


class ImageDataset(_FileDataset):
    """
    Images from a list of files, preprocessed as upstream improved-diffusion.

    Each image is repeatedly halved with a box filter while its short side is at least twice the
    resolution, resized with bicubic so that the short side equals the resolution, converted to
    RGB and center-cropped. Nothing is random, so loading is deterministic (also in workers).
    Arguments: see _FileDataset.
    """

    def __getitem__(self, idx):
        """
        :return: (arr: np.float32 [3, H, W] in [-1, 1], cond: {"y": np.int64 scalar} or {}).
        """
        path = self.local_images[idx]
        try:
            with bf.BlobFile(path, "rb") as f:
                pil_image = Image.open(f)
                pil_image.load()
        except Exception as e:
            raise DataError(f"cannot read image {path}: {e}; remove or replace the file") from e
        if pil_image.mode not in ("RGB", "L", "RGBA"):
            # Palette / bilevel / 16-bit images: convert first so resizing can interpolate.
            pil_image = pil_image.convert("RGB")
        arr = center_crop_arr(pil_image, self.resolution)
        arr = arr.astype(np.float32) / 127.5 - 1
        return np.transpose(arr, [2, 0, 1]), self._cond(idx)


class LatentDataset(_FileDataset):
    """
    Precomputed latents, one file per image: ``.npy`` holding one float array, or ``.npz`` holding
    exactly one, of shape [C, H, W] or [1, C, H, W] (fast-DiT's extract_features saves a batch of
    one). Taken as they are (no scaling, no clipping), as float32; H = W = ``resolution``.
    Files are read with ``allow_pickle=False``: a file can never run code. Arguments: see
    _FileDataset.
    """

    def __getitem__(self, idx):
        """:return: (arr: np.float32 [C, H, W], cond: {"y": np.int64 scalar} or {})."""
        path = self.local_images[idx]
        arr = read_latent(path)
        if arr.shape[1:] != (self.resolution, self.resolution):
            raise DataError(
                f"latent {path} has shape {list(arr.shape)}; this model takes "
                f"[C, {self.resolution}, {self.resolution}] (--image_size is the latent side); "
                f"give latents of one size")
        return arr, self._cond(idx)


def read_latent(path):
    """The array of one latent file as np.float32 [C, H, W] (see LatentDataset).

    :raises DataError: naming the file when it cannot be read or holds something else.
    """
    try:
        with bf.BlobFile(path, "rb") as f:
            loaded = np.load(io.BytesIO(f.read()), allow_pickle=False)
        if isinstance(loaded, np.lib.npyio.NpzFile):
            with loaded:
                names = list(loaded.files)
                if len(names) != 1:
                    raise DataError(f"latent {path} holds {len(names)} arrays ({', '.join(names)})"
                                    f"; give one array per file")
                arr = loaded[names[0]]
        else:
            arr = loaded
    except DataError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DataError(f"cannot read latent {path}: {e}; remove or replace the file") from e
    if arr.ndim == 4 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 3 or not np.issubdtype(arr.dtype, np.floating):
        raise DataError(f"latent {path} holds a {arr.dtype} array of shape {list(arr.shape)}; "
                        f"expected a float array [C, H, W]")
    return np.ascontiguousarray(arr, dtype=np.float32)


def _relative(path, root):
    """`path` relative to the folder `root` ("a/b.png"), or `path` itself if not under it."""
    root = root.rstrip("/")
    if root and path.startswith(root + "/"):
        return path[len(root) + 1:]
    return path


def center_crop_arr(pil_image, resolution):
    """
    Upstream's preprocessing: box-halve, bicubic-resize the short side to `resolution`, convert
    to RGB, center crop.

    :return: np.uint8 [resolution, resolution, 3].
    """
    while min(*pil_image.size) >= 2 * resolution:
        pil_image = pil_image.resize(
            tuple(x // 2 for x in pil_image.size), resample=Image.BOX
        )
    scale = resolution / min(*pil_image.size)
    pil_image = pil_image.resize(
        tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC
    )
    arr = np.array(pil_image.convert("RGB"))
    crop_y = (arr.shape[0] - resolution) // 2
    crop_x = (arr.shape[1] - resolution) // 2
    return arr[crop_y : crop_y + resolution, crop_x : crop_x + resolution]


def sample_order(seed, epoch, n, shuffle=True):
    """
    The order of dataset indices in one epoch: a pure function of (seed, epoch, n).

    :param shuffle: False (upstream's `deterministic=True`) gives 0..n-1 in every epoch.
    :return: np.int64 [n], a permutation of range(n).
    """
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([int(seed), int(epoch)])
    return rng.permutation(n).astype(np.int64)


def global_indices(position, count, n, seed, shuffle=True, _cache=None):
    """
    Dataset indices at global positions [position, position + count), spanning epochs.

    Position p lies in epoch p // n at offset p % n of `sample_order(seed, epoch, n)`.

    :param _cache: optional dict epoch -> order, reused across calls by ResumableLoader.
    :return: np.int64 [count].
    """
    if n <= 0:
        raise ValueError("cannot draw samples from an empty dataset")
    if position < 0 or count < 0:
        raise ValueError(f"position and count must be >= 0, got {position}, {count}")
    out = np.empty(count, dtype=np.int64)
    filled = 0
    p = int(position)
    while filled < count:
        epoch, offset = divmod(p, n)
        if _cache is not None and epoch in _cache:
            order = _cache[epoch]
        else:
            order = sample_order(seed, epoch, n, shuffle=shuffle)
            if _cache is not None:
                # Keep only the few most recent epochs.
                for old in [e for e in _cache if e < epoch - 1]:
                    del _cache[old]
                _cache[epoch] = order
        take = min(count - filled, n - offset)
        out[filled : filled + take] = order[offset : offset + take]
        filled += take
        p += take
    return out


def collate(items):
    """
    Stack dataset items into a batch.

    :param items: list of (np.float32 [C, H, W], cond dict of np values).
    :return: (th.float32 [B, C, H, W], dict of tensors, e.g. {"y": th.int64 [B]}).
    """
    batch = th.from_numpy(np.stack([x for x, _ in items]).astype(np.float32, copy=False))
    cond = {}
    if items and items[0][1]:
        for key in items[0][1]:
            cond[key] = th.from_numpy(np.stack([np.asarray(c[key]) for _, c in items]))
    return batch, cond


def _worker_init(worker_id):
    # The main process owns SIGTERM/SIGUSR1: a worker ignores them (preemption.ignore_in_worker).
    preemption.ignore_in_worker()
    # Loading is free of randomness; fix the generators anyway so nothing can differ per run.
    np.random.seed(worker_id)
    th.manual_seed(worker_id)


class _StepBatchSampler:
    """
    Yields one rank's index list for each global step from `position` on (endless). Holds no
    reference to its loader (a cycle through live worker iterators makes shutdown slow).
    """

    def __init__(self, *, position, n, seed, shuffle, rank, batch_size, world_size):
        self.position = position
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.rank, self.batch_size, self.world_size = rank, batch_size, world_size

    def __iter__(self):
        p = self.position
        cache = {}
        gb = self.batch_size * self.world_size
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        while True:
            idx = global_indices(p, gb, self.n, self.seed, self.shuffle, _cache=cache)
            yield idx[lo:hi].tolist()
            p += gb


class ResumableLoader:
    """
    An endless, resumable, rank-sharded iterator over a dataset.

    Each step consumes a global batch of `batch_size * world_size` samples starting at the global
    `position`; rank r yields the slice [r * batch_size, (r + 1) * batch_size). Use it as
    upstream's data generator: `batch, cond = next(loader)`.

    :param dataset: a map-style dataset returning (np.float32 [C, H, W], cond dict).
    :param batch_size: samples per rank per step (B).
    :param seed: seed of the sample order.
    :param rank: this process's rank; :param world_size: number of ranks.
    :param shuffle: False gives the dataset order (upstream's deterministic=True).
    :param num_workers: DataLoader worker processes (0 = load in this process). Workers only load
        the indices they are handed, so output does not depend on their number.
    :param position: global samples consumed so far.
    :param log: where a resume's warnings go, one line each (e.g. ``logger.warn``: printed once
        for the job, by rank 0's logger); None: ``warnings.warn``.

    Attributes: `position` (global samples consumed), `last_indices` (np.int64 [B], this rank's
    dataset indices in the last batch), `global_batch`.
    """

    def __init__(
        self,
        dataset,
        batch_size,
        *,
        seed=0,
        rank=0,
        world_size=1,
        shuffle=True,
        num_workers=0,
        position=0,
        log=None,
    ):
        if batch_size < 1:
            raise ValueError(f"--batch_size must be at least 1, got {batch_size}")
        if world_size < 1 or not (0 <= rank < world_size):
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        if len(dataset) == 0:
            raise DataError("the dataset is empty; check --data_dir")
        self.dataset = dataset
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.shuffle = bool(shuffle)
        self.num_workers = int(num_workers)
        self.position = int(position)
        self.last_indices = None
        self._order_cache = {}
        self._stream = None  # (iterator, position of its next batch) when using workers
        self._log = log

    def _warn(self, message):
        if self._log is None:
            warnings.warn(message)
        else:
            self._log(f"warning: {message}")

    @property
    def global_batch(self):
        return self.batch_size * self.world_size

    @property
    def num_samples(self):
        return len(self.dataset)

    @property
    def epoch(self):
        """The epoch of the next sample to be consumed."""
        return self.position // self.num_samples

    def _rank_indices(self, position):
        idx = global_indices(
            position, self.global_batch, self.num_samples, self.seed, self.shuffle,
            _cache=self._order_cache,
        )
        return idx[self.rank * self.batch_size : (self.rank + 1) * self.batch_size]

    def peek_indices(self, position=None):
        """This rank's dataset indices for the step starting at `position` (default: next)."""
        return self._rank_indices(self.position if position is None else position)

    def __iter__(self):
        return self

    def __next__(self):
        """:return: (th.float32 [B, C, H, W] in [-1, 1], cond dict of tensors)."""
        indices = self._rank_indices(self.position)
        if self.num_workers > 0:
            batch = self._next_from_workers()
        else:
            batch = collate([self.dataset[int(i)] for i in indices])
        self.last_indices = indices
        self.position += self.global_batch
        return batch

    def _next_from_workers(self):
        if self._stream is None or self._stream[1] != self.position:
            self.close()  # drop the old workers before starting new ones
            dl = DataLoader(
                # a user's data error comes back as its own one line (loader_workers)
                loader_workers.FailuresAsValues(self.dataset),
                batch_sampler=_StepBatchSampler(
                    position=self.position, n=self.num_samples, seed=self.seed,
                    shuffle=self.shuffle, rank=self.rank, batch_size=self.batch_size,
                    world_size=self.world_size,
                ),
                num_workers=self.num_workers,
                prefetch_factor=PREFETCH_BATCHES,
                pin_memory=th.cuda.is_available(),
                collate_fn=loader_workers.Collate(collate),
                worker_init_fn=_worker_init,
                # Its own generator: creating the iterator draws a base seed, which must not
                # advance the global torch RNG (a resumed run would then differ from a straight
                # one, since a resume creates the iterator at a different step).
                generator=th.Generator().manual_seed(self.seed),
            )
            with preemption.starting_workers():
                self._stream = [iter(dl), self.position]
            loader_workers.stop_at_exit(self)
        batch = loader_workers.raise_failure(next(self._stream[0]))
        self._stream[1] += self.global_batch
        return batch

    def fingerprint(self):
        """The dataset's `fingerprint()` ({"num_files", "sha256"}), or its size alone."""
        fn = getattr(self.dataset, "fingerprint", None)
        return fn() if callable(fn) else {"num_files": len(self.dataset), "sha256": None}

    def close(self):
        """Stop the worker processes, if any (they restart on the next batch)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            loader_workers.shutdown(stream[0])

    def state_dict(self):
        """:return: {"position", "seed", "num_samples", "shuffle"} (plain python values)."""
        return {
            "position": int(self.position),
            "seed": int(self.seed),
            "num_samples": int(self.num_samples),
            "shuffle": bool(self.shuffle),
        }

    def load_state_dict(self, sd):
        """
        Continue from a saved state. The position is global, so the state is valid on any world
        size and batch size. The saved seed and shuffle setting are adopted (the run's order must
        not change mid-run); a different dataset size is warned about.
        """
        n_saved = int(sd.get("num_samples", self.num_samples))
        if n_saved != self.num_samples:
            self._warn(
                f"the data position was saved for {n_saved} samples but the dataset now has "
                f"{self.num_samples}; the sample order continues but is not the saved run's"
            )
        if "seed" in sd and int(sd["seed"]) != self.seed:
            self._warn(
                f"data seed {self.seed} replaced by the checkpoint's seed {int(sd['seed'])}"
            )
            self.seed = int(sd["seed"])
        if "shuffle" in sd:
            self.shuffle = bool(sd["shuffle"])
        self.position = int(sd["position"])
        self._order_cache = {}
        self.close()


# Batches each loader worker prepares ahead of the one being consumed (DataLoader's
# prefetch_factor): the loader stays this many batches ahead of the training step.
PREFETCH_BATCHES = 4


def auto_num_workers(device=None, affinity=None, host_cpus=None, local_ranks=None):
    """The worker count of --num_workers -1 (the default): loading runs beside the step.

    On a GPU the step does not use the CPU cores: one worker per spare core of this rank's share
    (dist_util.cpu_share: its own CPU affinity when the launcher bound it to part of the host,
    as ``srun --cpus-per-task=6`` does, else the host's cores / the ranks on it), minus the
    training process, at most 8; at least 1. On the CPU the step's own threads take every core
    and a step consumes its batch far slower than one process decodes it (benchmarks/loader.py),
    so loading stays in the training process (0).
    """
    device = device if device is not None else dist_util.dev()
    if th.device(device).type != "cuda":
        return 0
    ranks = local_ranks if local_ranks is not None else dist_util.get_local_world_size()
    return max(1, min(8, dist_util.cpu_share(ranks, affinity, host_cpus) - 1))


def _default_rank_world():
    return dist_util.get_rank(), dist_util.get_world_size()


def load_data(
    *,
    data_dir,
    batch_size,
    image_size,
    class_cond=False,
    deterministic=False,
    seed=0,
    rank=None,
    world_size=None,
    num_workers=0,
    num_classes=None,
    in_channels=None,
    log=None,
):
    """
    A ResumableLoader over the images (or latents) in `data_dir` (upstream's load_data,
    resumable).

    :param class_cond: if True, cond holds "y": th.int64 [B], the class of each file
        (`class_labels`: its folder, or its name before the first "_"); the loader's
        ``class_rule`` and ``class_names`` (label order) say which rule and which classes.
    :param deterministic: if True, visit samples in file order instead of a seeded shuffle.
    :param rank, world_size: default to dist_util's (0, 1 without a process group).
    :param num_workers: loader worker processes; -1 (--num_workers's default) picks
        auto_num_workers() for this device. The output never depends on it.
    :param num_classes: with class_cond, the model's number of classes: a folder with more
        class names raises DataError (instead of an IndexError inside the model).
    :param in_channels: the model's input channels, when known: a folder whose files have
        another count raises DataError (images have 3; latents the C of their first file).
    :param log: where a resume's warnings go (ResumableLoader's ``log``).
    :return: ResumableLoader yielding (th.float32 [B, C, image_size, image_size], cond): images
        in [-1, 1] (C = 3), or latents as stored.
    """
    if not data_dir:
        raise DataError("unspecified data directory; pass --data_dir DIR (an image folder)")
    if not bf.exists(data_dir) or not bf.isdir(data_dir):
        raise DataError(
            f"--data_dir {data_dir} does not exist or is not a directory; "
            f"pass an image folder (e.g. make one with datasets/digits.py)"
        )
    kind, all_files = list_data_files(data_dir)
    if not all_files:
        raise DataError(
            f"--data_dir {data_dir} holds no images ({', '.join(IMAGE_EXTENSIONS)}) or latents "
            f"({', '.join(LATENT_EXTENSIONS)}); pass a folder of images or latents"
        )
    channels = read_latent(all_files[0]).shape[0] if kind == "latents" else 3
    if in_channels is not None and channels != in_channels:
        what = (f"latents with {channels} channels (e.g. {all_files[0]})" if kind == "latents"
                else "RGB images (3 channels)")
        raise DataError(f"--data_dir {data_dir} holds {what} but the model has --in_channels "
                        f"{in_channels}; pass --in_channels {channels} or another folder")
    classes = rule = names = None
    if class_cond:
        rule, names, classes = class_labels(data_dir, all_files)
        if num_classes is not None and len(names) > num_classes:
            shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
            raise DataError(
                f"--data_dir {data_dir} holds {len(names)} classes ({CLASS_RULES[rule]}: "
                f"{shown}) but the model has --num_classes {num_classes}"
            )
    if rank is None or world_size is None:
        r, w = _default_rank_world()
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    make = LatentDataset if kind == "latents" else ImageDataset
    dataset = make(image_size, all_files, classes=classes, root=data_dir)
    if num_workers is None or int(num_workers) < 0:
        num_workers = auto_num_workers()
    loader = ResumableLoader(
        dataset,
        batch_size,
        seed=seed,
        rank=rank,
        world_size=world_size,
        shuffle=not deterministic,
        num_workers=num_workers,
        log=log,
    )
    loader.class_rule, loader.class_names = rule, names  # None without class_cond
    # the VAE that made a latent folder (datasets/vae_latents.py's vae.json), for the checkpoints
    loader.vae = read_latent_vae(data_dir) if kind == "latents" else None
    return loader


# datasets/vae_latents.py's record of the VAE that encoded a latent folder: {"source", "sha256",
# "scale"} (the sha256 of its weights, vae_latents.vae_identity).
LATENT_VAE_FILE = "vae.json"


def read_latent_vae(data_dir):
    """The latent folder's vae.json as a dict ({"source", "sha256", "scale"}), or None when the
    folder has none (latents made elsewhere).

    :raises DataError: a vae.json that is not readable JSON with a "sha256" string.
    """
    path = bf.join(data_dir, LATENT_VAE_FILE)
    if not bf.exists(path):
        return None
    try:
        with bf.BlobFile(path, "rb") as f:
            rec = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read {path}: {e}; remove it or write it again with "
                        f"datasets/vae_latents.py encode") from e
    if not isinstance(rec, dict) or not isinstance(rec.get("sha256"), str):
        raise DataError(f"{path} names no VAE (no \"sha256\" string); remove it or write it "
                        f"again with datasets/vae_latents.py encode")
    return rec
