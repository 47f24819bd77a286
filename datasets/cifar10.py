"""
Download CIFAR-10 and write it as image folders, as upstream's datasets/cifar10.py does:
`cifar_train/` and `cifar_test/` with files `{class}_{index:05d}.png` (class = plane, car, ...),
so `load_data(class_cond=True)` reads the class from the file name.

NEEDS THE NETWORK (about 163 MB from www.cs.toronto.edu) unless `--archive` names a copy of
`cifar-10-python.tar.gz` that is already on disk. Unlike upstream it does not need torchvision:
the archive is fetched with urllib, its MD5 checked, and the pickled batches read directly.

    python datasets/cifar10.py [--out_dir .] [--archive cifar-10-python.tar.gz]

A split whose folder already exists is skipped.
"""
import argparse
import hashlib
import os
import pickle
import shutil
import sys
import tarfile
import tempfile
import urllib.request

import numpy as np
from PIL import Image

URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
MD5 = "c58f30108f718f92721af3b95e74349a"
CLASSES = ("plane", "car", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")
SPLITS = {
    "train": [f"data_batch_{i}" for i in range(1, 6)],
    "test": ["test_batch"],
}


def md5sum(path):
    h = hashlib.md5()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download(dest_path, url=URL):
    """Fetch the archive to dest_path (via a temporary name) and check its MD5."""
    print(f"downloading {url} ...", flush=True)
    tmp = dest_path + ".part"
    with urllib.request.urlopen(url) as r, open(tmp, "wb") as f:
        shutil.copyfileobj(r, f)
    if md5sum(tmp) != MD5:
        os.remove(tmp)
        raise OSError(f"downloaded {url} but its MD5 does not match; try again")
    os.replace(tmp, dest_path)
    return dest_path


def read_batches(archive_path, names):
    """
    :return: (images uint8 [N, 32, 32, 3], labels int64 [N]) of the named batches, in order.
    """
    images, labels = [], []
    with tarfile.open(archive_path, "r:gz") as tar:
        members = {os.path.basename(m.name): m for m in tar.getmembers() if m.isfile()}
        for name in names:
            if name not in members:
                raise OSError(f"{archive_path} holds no {name}; is it cifar-10-python.tar.gz?")
            d = pickle.load(tar.extractfile(members[name]), encoding="bytes")
            data = np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
            images.append(data.transpose(0, 2, 3, 1))
            labels.append(np.asarray(d[b"labels"], dtype=np.int64))
    return np.concatenate(images), np.concatenate(labels)


def write_split(archive_path, split, out_dir):
    images, labels = read_batches(archive_path, SPLITS[split])
    tmp_dir = out_dir + ".tmp"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    os.makedirs(tmp_dir)
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        def tqdm(x, **_):
            return x
    for i in tqdm(range(len(images)), desc=f"dumping {split}"):
        name = f"{CLASSES[labels[i]]}_{i:05d}.png"
        Image.fromarray(images[i]).save(os.path.join(tmp_dir, name))
    os.replace(tmp_dir, out_dir)  # the folder appears only once complete
    return len(images)


def main(argv=None):
    parser = argparse.ArgumentParser(description="Write CIFAR-10 as image folders (needs network).")
    parser.add_argument("--out_dir", default=".", help="where cifar_train/ and cifar_test/ go")
    parser.add_argument("--archive", default=None,
                        help="an existing cifar-10-python.tar.gz (skips the download)")
    args = parser.parse_args(argv)
    try:
        todo = []
        for split in SPLITS:
            out = os.path.join(args.out_dir, f"cifar_{split}")
            if os.path.exists(out):
                print(f"skipping split {split} since {out} already exists.")
            else:
                todo.append((split, out))
        if not todo:
            return 0
        os.makedirs(args.out_dir, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            archive = args.archive
            if archive is None:
                archive = download(os.path.join(tmp, "cifar-10-python.tar.gz"))
            elif not os.path.isfile(archive):
                raise FileNotFoundError(f"--archive {archive} not found; give the downloaded .tar.gz")
            for split, out in todo:
                n = write_split(archive, split, out)
                print(f"wrote {n} images to {out}")
    except (OSError, pickle.UnpicklingError, tarfile.TarError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
