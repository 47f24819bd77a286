"""
The one storage layer of a run dir: every read, write, list and remove of a log dir, a
checkpoint path or a text log goes through here, for local paths and for object stores alike.

Paths:

* local paths (anything without ``://``): the os module. Writers keep their own temp name +
  fsync + no-overwrite rename (file_writer); this module adds nothing there.
* ``s3://bucket/key`` (s3fs), ``gs://bucket/key`` (gcsfs), ``az://container/key`` (adlfs), and
  any other protocol fsspec knows. Endpoints and credentials come only from each store's
  standard environment, never from our flags:

    s3   the AWS chain (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance or
         pod role); AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3) for a server other than AWS
    gs   application default credentials (GOOGLE_APPLICATION_CREDENTIALS, gcloud auth
         application-default login, the metadata server); STORAGE_EMULATOR_HOST for an emulator
    az   AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with
         AZURE_STORAGE_ACCOUNT_KEY / AZURE_STORAGE_SAS_TOKEN / a service principal
         (AZURE_STORAGE_CLIENT_ID, _SECRET, _TENANT_ID); the URL is az://CONTAINER/key (adlfs's
         form; the account is the environment's)

Object stores have no rename and no append. A file is put under its final name in one go:
``open(path, "wb")`` streams it (multipart above ``BLOCK_BYTES``: the bytes are never held twice
in memory) and the object appears only when the file is closed; a write that fails is discarded,
never published half-written (``open`` as a context manager does that). A step's commit is its
manifest, written last (run_dir.write_step). ``put(path, data, exclusive=True)`` is the store's
conditional create (S3 ``If-None-Match: *``, GCS ``ifGenerationMatch=0``, Azure
``If-None-Match: *``): False when the object is already there.

Errors: a store's error that is not already an OSError is raised as ``StoreError`` (an OSError,
so every caller that handles a failed read or write handles it); not found is
FileNotFoundError, refused credentials or access (401, 403) PermissionError. Throttling, 5xx
answers and dropped connections are retried ``len(RETRY_PAUSES)`` times with growing pauses,
about 30 s in all (``retrying``; ``ID_STORE_RETRY_S`` sets another total), on top of the client
library's own retries; nothing else is retried; a whole streamed write is retried only where
the caller can write it again (put). ``write_failure_message`` words a failed write in one line
(the URL, the store's answer, what to do: write_fault_message below, for a store).
``check_store(url)`` is the one-line ``StoreUnreachableError`` (a
UserError) for a store that cannot be reached or refuses the credentials, raised before
training starts (run_lock calls it).

Nothing here is collective; rank 0 writes.
"""

import errno
import io
import os
import posixpath
import re
import time
from dataclasses import dataclass

from .errors import UserError

# Pauses (seconds) between the tries of one store call that failed transiently (throttling, 5xx,
# a dropped connection): about 30 s in all before the error is raised; $RETRY_ENV (seconds)
# scales them to another total (retry_pauses).
RETRY_PAUSES = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)
RETRY_ENV = "ID_STORE_RETRY_S"
# Part size of a streamed upload (the memory one open write holds), and of a streamed read's
# ranged requests.
BLOCK_BYTES = 16 << 20
# A peek's ranged requests (open's block_size): a checkpoint's pickle and zip directory without
# its tensors is a few of these.
PEEK_BYTES = 256 << 10


class StoreError(OSError):
    """A store's error that is not an OSError of its own (its type and text in the message)."""


class StoreUnreachableError(UserError):
    """The log dir's store cannot be reached or refuses the credentials (one line: the URL,
    what happened, which variables to set)."""


def is_remote(path):
    return "://" in os.fspath(path)


def protocol(path):
    path = os.fspath(path)
    return path.split("://", 1)[0] if "://" in path else "file"


# ---------------------------------------------------------------------------------------------
# names (blobfile's functions of the same names, for local paths and URLs)


def join(d, *names):
    d = os.fspath(d)
    if not is_remote(d):
        return os.path.join(d, *names)
    out = d
    for name in names:
        out = out.rstrip("/") + "/" + name.lstrip("/") if name else out.rstrip("/") + "/"
    return out


def dirname(path):
    path = os.fspath(path)
    if not is_remote(path):
        return os.path.dirname(path)
    scheme, rest = path.split("://", 1)
    rest = rest.rstrip("/")
    if "/" not in rest:
        return path  # a bucket's root
    return f"{scheme}://{rest.rsplit('/', 1)[0]}"


def basename(path):
    path = os.fspath(path)
    return posixpath.basename(path.rstrip("/")) if is_remote(path) else os.path.basename(path)


# ---------------------------------------------------------------------------------------------
# file systems and errors

_FS = {}


def filesystem(path):
    """(fsspec file system, the path as that file system spells it) for a URL. The instance is
    made once per protocol and process (fsspec also remakes it in a forked child)."""
    import fsspec

    path = os.fspath(path)
    scheme = protocol(path)
    fs = _FS.get((scheme, os.getpid()))
    if fs is None:
        try:
            if scheme in ("gs", "gcs"):
                # gcsfs' plain client: its default (experimental zonal/HNS buckets) asks a gRPC
                # control API about each bucket first, which an emulator does not serve
                from gcsfs.core import GCSFileSystem as cls
            else:
                cls = fsspec.get_filesystem_class(scheme)
        except (ImportError, ValueError) as e:
            raise StoreUnreachableError(
                f"{path}: no client for {scheme}:// ({e}); install the test/cloud extra "
                f"(pip install s3fs gcsfs adlfs) or use a local --log_dir") from None
        fs = cls(**_options(scheme))
        _FS[(scheme, os.getpid())] = fs
    return fs, fs._strip_protocol(path)


def forget_clients():
    """Drop this process's store clients, and what ``retrying`` learned of their stores: the
    next call makes new ones from the environment as it is then (a test that points a store's
    variables elsewhere)."""
    _FS.clear()
    _GAVE_UP.clear()


def _options(scheme):
    """What our stores need beyond fsspec's defaults (no listings cache: another job's or
    process's writes are seen at once); every endpoint and credential comes from the store's
    own environment."""
    return dict(_store_options(scheme), use_listings_cache=False, skip_instance_cache=True)


def _store_options(scheme):
    if scheme in ("s3", "s3a"):
        opts = {"default_block_size": BLOCK_BYTES}
        # botocore reads AWS_ENDPOINT_URL itself; s3fs' default region lookup does not need it
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        if endpoint:
            opts["endpoint_url"] = endpoint
        return opts
    if scheme in ("gs", "gcs"):
        opts = {"block_size": BLOCK_BYTES}
        if os.environ.get("STORAGE_EMULATOR_HOST"):
            opts["token"] = "anon"  # an emulator takes no credentials
        return opts
    if scheme in ("az", "abfs", "abfss"):
        return {"blocksize": BLOCK_BYTES}
    return {}


_TRANSIENT = re.compile(
    r"\b(500|502|503|504|429)\b|SlowDown|Throttl|ServiceUnavailable|InternalError|"
    r"RequestTimeout|Too Many Requests|ServerBusy|OperationTimedOut|Connection (reset|aborted)|"
    r"Cannot connect|Connect(ion)? ?(refused|timeout|error)|ServerDisconnected|"
    r"Remote end closed|EndpointConnectionError|Could not connect|timed out|temporarily",
    re.I)


def retry_pauses():
    """The pauses of ``retrying``: RETRY_PAUSES, scaled to add up to $ID_STORE_RETRY_S seconds
    when that is set (0: no retries of ours, the client library's own remain)."""
    budget = os.environ.get(RETRY_ENV, "").strip()
    if not budget:
        return RETRY_PAUSES
    try:
        total = float(budget)
    except ValueError:
        raise UserError(f"{RETRY_ENV}={budget!r}: not a number of seconds; set it to the "
                        f"seconds a failing store call is retried (default "
                        f"{sum(RETRY_PAUSES):.0f}), or unset it") from None
    if total <= 0:
        return ()
    return tuple(p * total / sum(RETRY_PAUSES) for p in RETRY_PAUSES)


def is_transient(e):
    """Whether a store's error is worth another try (throttling, 5xx, a dropped connection)."""
    if isinstance(e, (FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError,
                      PermissionError)):
        return False
    if isinstance(e, (ConnectionError, TimeoutError)):
        return True
    text = f"{type(e).__name__}: {e}"
    cause = e.__cause__ or e.__context__
    if cause is not None:
        text += f" {type(cause).__name__}: {cause}"
    return bool(_TRANSIENT.search(text))


def _as_oserror(e, path):
    """A store's exception as an OSError (the same object when it is one, but a refusal that
    a client raised as a plain OSError, gcsfs' "Forbidden: URL ...", is a PermissionError)."""
    if isinstance(e, OSError):
        if type(e) is OSError and e.errno is None and re.match(r"(Forbidden|Unauthorized)\b",
                                                                str(e)):
            return PermissionError(errno.EACCES, " ".join(str(e).split())[:300],
                                   os.fspath(path))
        return e
    name = type(e).__name__
    text = " ".join(str(e).split())[:300] or name
    if name in ("ResourceNotFoundError", "NoSuchKey", "NoSuchBucket", "NotFound"):
        return FileNotFoundError(errno.ENOENT, text, os.fspath(path))
    if name in ("ResourceExistsError",):
        return FileExistsError(errno.EEXIST, text, os.fspath(path))
    status = getattr(e, "status_code", None) or getattr(e, "code", None)  # azure, gcsfs
    if status in (401, 403) or (
            name in ("ClientAuthenticationError", "NoCredentialsError", "Forbidden",
                     "HttpResponseError", "HttpError")
            and re.search(r"\b(401|403)\b|auth|credential|Forbidden|AccessDenied", text, re.I)):
        return PermissionError(errno.EACCES, f"{name}: {text}", os.fspath(path))
    return StoreError(f"{name}: {text}")


def retrying(fn, path, pauses=None):
    """``fn()``, tried again after each of ``pauses`` (retry_pauses()) while it fails
    transiently (is_transient); the last error is raised as an OSError (_as_oserror). Once a
    call of a store has failed transiently through all its pauses, the next calls of that
    store are tried once each until one succeeds (a job that ends on a store that is down
    spends the retries once, not again in each call of its teardown). Local paths: once."""
    if not is_remote(path):
        return fn()
    scheme = protocol(path)
    if pauses is None:
        pauses = () if scheme in _GAVE_UP else retry_pauses()
    for pause in (*pauses, None):
        try:
            result = fn()
        except Exception as e:
            if pause is None or not is_transient(e):
                if pause is None and pauses and is_transient(e):
                    _GAVE_UP.add(scheme)
                raise _as_oserror(e, path) from e
            time.sleep(pause)
        else:
            _GAVE_UP.discard(scheme)
            return result


# The stores (protocols) whose last call failed transiently through all its retries (retrying).
_GAVE_UP = set()


# ---------------------------------------------------------------------------------------------
# reading and listing


@dataclass
class Stat:
    size: int
    mtime: float


def exists(path):
    path = os.fspath(path)
    if not is_remote(path):
        return os.path.lexists(path)
    fs, p = filesystem(path)
    return retrying(lambda: fs.exists(p), path)


def isdir(path):
    path = os.fspath(path)
    if not is_remote(path):
        return os.path.isdir(path)
    fs, p = filesystem(path)

    def ask():  # not from a cached listing: one made before a folder appeared says "no"
        fs.invalidate_cache(p)
        return fs.isdir(p)

    return retrying(ask, path)


def stat(path):
    """Stat(size, mtime); FileNotFoundError when missing."""
    path = os.fspath(path)
    if not is_remote(path):
        s = os.stat(path)
        return Stat(s.st_size, s.st_mtime)
    fs, p = filesystem(path)
    info = retrying(lambda: fs.info(p), path)
    if info.get("type") == "directory":
        raise IsADirectoryError(errno.EISDIR, "is a directory", path)
    mtime = info.get("LastModified") or info.get("last_modified") or info.get("updated") \
        or info.get("mtime") or 0.0
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    elif isinstance(mtime, str):
        import datetime
        try:
            mtime = datetime.datetime.fromisoformat(mtime.replace("Z", "+00:00")).timestamp()
        except ValueError:
            mtime = 0.0
    return Stat(int(info.get("size") or 0), float(mtime))


def size(path):
    return stat(path).size


def listdir(d):
    """Names in directory (prefix) ``d``, sorted; FileNotFoundError when there is none (an
    object store: no object under the prefix)."""
    d = os.fspath(d)
    if not is_remote(d):
        return sorted(os.listdir(d))
    fs, p = filesystem(d)

    def ls():
        fs.invalidate_cache(p)
        return fs.ls(p, detail=False)

    names = {posixpath.basename(e.rstrip("/")) for e in retrying(ls, d)}
    names.discard("")
    return sorted(names)


def glob(pattern):
    """Paths matching ``pattern`` (``*``, ``?``), sorted, in the pattern's own spelling."""
    pattern = os.fspath(pattern)
    if not is_remote(pattern):
        import glob as _glob
        return sorted(_glob.glob(pattern))
    d = dirname(pattern)
    import fnmatch
    try:
        names = listdir(d)
    except FileNotFoundError:
        return []
    return [join(d, n) for n in names if fnmatch.fnmatchcase(n, basename(pattern))]


def read_bytes(path):
    path = os.fspath(path)
    if not is_remote(path):
        with open(path, "rb") as f:
            return f.read()
    fs, p = filesystem(path)
    return retrying(lambda: fs.cat_file(p), path)


# ---------------------------------------------------------------------------------------------
# writing


def makedirs(path):
    """A local directory (and its parents); nothing for an object store, whose prefixes exist
    once an object is under them."""
    path = os.fspath(path)
    if not is_remote(path):
        os.makedirs(path, exist_ok=True)


def remove(path):
    """Remove one file or object (an object-store "folder": every object under it);
    FileNotFoundError when missing."""
    path = os.fspath(path)
    if not is_remote(path):
        os.unlink(path)
        return
    fs, p = filesystem(path)
    fs.invalidate_cache(p)
    if not retrying(lambda: fs.exists(p), path):
        raise FileNotFoundError(errno.ENOENT, "no such object", path)
    if retrying(lambda: fs.isdir(p), path):
        retrying(lambda: fs.rm(p, recursive=True), path)
    else:
        retrying(lambda: fs.rm_file(p), path)
    fs.invalidate_cache(p)


def put(path, data, exclusive=False):
    """Put ``data`` (bytes) as the whole of the file or object ``path``, retried as one call.
    ``exclusive``: only when there is nothing there yet (the store's conditional create);
    returns False when there was. Object stores: the object appears complete or not at all.
    Local paths: written in place (callers that need atomicity use file_writer)."""
    path = os.fspath(path)
    if not is_remote(path):
        try:
            with open(path, "xb" if exclusive else "wb") as f:
                f.write(data)
        except FileExistsError:
            return False
        return True
    fs, p = filesystem(path)

    def once():
        fs.pipe_file(p, bytes(data), mode="create" if exclusive else "overwrite")
    try:
        retrying(once, path)
    except (FileExistsError, StoreError) as e:
        if exclusive and (isinstance(e, FileExistsError) or _precondition_failed(e)):
            return False
        raise
    fs.invalidate_cache(p)
    return True


def _precondition_failed(e):
    text = f"{e} {e.__cause__}"
    return bool(re.search(r"\b412\b|PreconditionFailed|ConditionNotMet|BlobAlreadyExists|"
                          r"already exists|conditionNotMet", text, re.I))


def copy(src, dst):
    """Copy one file or object to a new name in the same store."""
    src, dst = os.fspath(src), os.fspath(dst)
    if not is_remote(src):
        import shutil
        shutil.copyfile(src, dst)
        return
    fs, s = filesystem(src)
    _, d = filesystem(dst)
    retrying(lambda: fs.copy(s, d), src)


class _StreamedWrite(io.RawIOBase):
    """A write-only stream to an object: parts are uploaded as they fill, the object appears at
    ``close()``; ``discard()`` (and leaving a ``with`` block by an exception) drops it instead.
    ``restart()``: start the object over (nothing of the first try is published)."""

    def __init__(self, path, exclusive):
        self.path = path
        self._exclusive = exclusive
        self._fs, self._p = filesystem(path)
        self._f = None
        self._open()

    def _open(self):
        mode = "xb" if self._exclusive else "wb"
        self._f = retrying(lambda: self._fs.open(self._p, mode), self.path)

    def writable(self):
        return True

    def write(self, data):
        try:
            return self._f.write(data)
        except Exception as e:
            raise _as_oserror(e, self.path) from e

    def flush(self):
        pass  # parts go out as they fill; the rest at close

    def tell(self):
        return self._f.tell()

    def restart(self):
        self._drop()
        self._open()

    def _drop(self):
        f, self._f = self._f, None
        if f is None:
            return
        try:
            f.discard()
        except Exception:
            pass
        f.closed = True  # fsspec would commit what it has when the object is collected

    def discard(self):
        self._drop()
        super().close()

    def close(self):
        if self._f is not None and not self.closed:
            f = self._f
            try:
                f.close()
            except Exception as e:
                self._drop()
                if self._exclusive and _precondition_failed(e):
                    raise FileExistsError(errno.EEXIST, "already exists", self.path) from e
                raise _as_oserror(e, self.path) from e
            self._f = None
            self._fs.invalidate_cache(self._p)
        super().close()

    def __exit__(self, exc_type, *rest):
        if exc_type is not None:
            self.discard()
        else:
            self.close()


def open_write(path, exclusive=False):
    """A binary write stream to ``path``: local, a plain file (the caller renames); an object,
    a _StreamedWrite (see there). ``exclusive``: the store refuses the object at close when one
    is there by then (FileExistsError)."""
    path = os.fspath(path)
    if not is_remote(path):
        return open(path, "xb" if exclusive else "wb")
    return _StreamedWrite(path, exclusive)


def open(path, mode="rb", block_size=None):  # noqa: A001 - blobfile's BlobFile
    """A file for ``mode`` "rb"/"r" (read, streamed in blocks) or "wb"/"w" (open_write); text
    modes wrap it in UTF-8. ``block_size``: an object read's bytes per ranged request
    (BLOCK_BYTES when None): a small one (PEEK_BYTES) for a reader that reads a few places of
    a large object (a checkpoint's pickle, not its tensors: checkpoint.read_flags)."""
    import builtins

    path = os.fspath(path)
    if not is_remote(path):
        return builtins.open(path, mode)
    if "r" in mode:
        fs, p = filesystem(path)
        f = retrying(lambda: fs.open(p, "rb", block_size=block_size or BLOCK_BYTES), path)
    elif "w" in mode or "x" in mode:
        f = open_write(path, exclusive="x" in mode)
    else:
        raise ValueError(f"{path}: mode {mode!r} is not supported on an object store (no append)")
    if "b" not in mode:
        return io.TextIOWrapper(f if "r" in mode else io.BufferedWriter(f), encoding="utf-8")
    return f


BlobFile = open  # blobfile's name, for upstream's call sites

# What callers catch for a failed store call (blobfile's bf.Error): every error here is one.
Error = OSError


# ---------------------------------------------------------------------------------------------
# before training


_WHAT_TO_SET = {
    "s3": "set AWS_ENDPOINT_URL for a server other than AWS and credentials through the AWS "
          "chain (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role)",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS (or run gcloud auth application-default login), or "
          "STORAGE_EMULATOR_HOST for an emulator",
    "az": "set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME with "
          "AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_TOKEN",
}


def check_store(url, flag="--log_dir", pauses=()):
    """Raise StoreUnreachableError (one line: the flag and URL, what happened, what to set)
    unless the store of ``url`` answers a listing of its bucket/container with these
    credentials. Local paths: nothing. Only the client library's own retries (``pauses``: ours,
    none by default): a store that is down is said within seconds, before training starts. Not
    collective."""
    url = os.fspath(url)
    if not is_remote(url):
        return
    scheme = protocol(url)
    hint = _WHAT_TO_SET.get({"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az"}
                            .get(scheme, scheme), "check the store's environment variables")
    try:
        fs, p = filesystem(url)
        bucket = p.split("/", 1)[0]
        retrying(lambda: fs.ls(bucket, detail=False), url, pauses)
    except StoreUnreachableError:
        raise
    except FileNotFoundError:
        raise StoreUnreachableError(
            f"{flag} {url}: the bucket/container {bucket!r} does not exist at this store; create "
            f"it, or check the URL and the endpoint ({hint})") from None
    except PermissionError as e:
        raise StoreUnreachableError(
            f"{flag} {url}: the store refuses these credentials "
            f"({' '.join(str(e).split())[:160]}); {hint}") from None
    except Exception as e:
        raise StoreUnreachableError(
            f"{flag} {url}: the store cannot be reached ({type(e).__name__}: "
            f"{' '.join(str(e).split())[:160]}); {hint}") from None


# ---------------------------------------------------------------------------------------------
# a failed write, in one line


def answer_of(e):
    """The store's answer that ``e`` (an error of a store call) carries, on one line: its
    type and text, an XML error body as ``Code: Message``, and the status or error code of its
    cause when its own text has none."""
    def text(x):
        t = " ".join(str(x).split())
        code = re.search(r"<Code>(.*?)</Code>", t)
        if code:
            msg = re.search(r"<Message>(.*?)</Message>", t)
            status = re.search(r"\b([45]\d\d)\b\W*$", t)
            t = code.group(1) + (f": {msg.group(1)}" if msg else "") + \
                (f" ({status.group(1)})" if status else "")
        return t
    own = e.strerror if isinstance(e, OSError) and e.strerror else e  # without errno, path
    out = f"{type(e).__name__}: {text(own)}".rstrip(": ")
    cause = e.__cause__ or e.__context__
    if cause is not None and cause is not e and not re.search(r"\b[45]\d\d\b", out):
        extra = text(cause)
        if extra and extra not in out:
            out += f" ({type(cause).__name__}: {extra})"
    return out[:300]


def write_failure_message(e, url, doing, kept):
    """One line for a write into ``url`` (a log dir or folder in a store) that failed with
    ``e``: "URL: <what the store answered> while <doing>; <kept>; <what to do>"; None when
    ``e`` is no store's error (not an OSError: a bug, raised as it is). Refused access (401,
    403) names the variables to check; an answer that stayed transient through the retries
    says how long they were. A full or read-only local disk under the client (its temporary
    files) is not worded here (file_writer's disk faults)."""
    if not isinstance(e, OSError) or e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
        return None
    answer = answer_of(e)
    scheme = {"s3a": "s3", "gcs": "gs", "abfs": "az", "abfss": "az"}.get(protocol(url),
                                                                          protocol(url))
    hint = _WHAT_TO_SET.get(scheme, "check the store's environment variables")
    if isinstance(e, PermissionError):
        what = f"permission denied by the store ({answer})"
        todo = f"give these credentials write access there ({hint}) and rerun"
    elif is_transient(e) or e.errno in (errno.EBUSY, errno.EAGAIN):
        pauses = retry_pauses()
        what = f"the store kept failing ({answer}; retried for up to {sum(pauses):.0f} s)"
        todo = (f"rerun once the store answers again ({RETRY_ENV} sets the seconds a failing "
                f"call is retried)")
    else:
        what = f"the store answered {answer}"
        todo = "rerun the same command"
    return f"{url}: {what} while {doing}; {kept}; {todo}"


# ------------------------------------------------- the wording of a failed write (disk faults)


# errno -> (what happened, what to do); the message names the directory before them.
_FAULTS = {
    errno.ENOSPC: ("no space left on device",
                   "free space there (delete old steps, or pass --keep_checkpoints N) or copy the "
                   "log dir to a bigger disk and rerun with --log_dir there"),
    errno.EDQUOT: ("disk quota exceeded (no space left for this user)",
                   "free space there (delete old steps, or pass --keep_checkpoints N) or raise "
                   "the quota"),
    errno.EROFS: ("read-only file system",
                  "remount it read-write, or copy the log dir to a writable disk and rerun with "
                  "--log_dir there"),
    errno.EACCES: ("permission denied",
                   "give this user write access to it (or rerun with another --log_dir)"),
    errno.EPERM: ("permission denied (operation not permitted)",
                  "give this user write access to it (or rerun with another --log_dir)"),
}
_GONE = ("the log dir no longer exists (removed while the job ran?)",
         "it is not recreated, since an empty log dir would hide the lost checkpoints: restore it "
         "and rerun, or rerun with a new --log_dir to start over")
# What is left of a log dir that is gone (in place of the caller's ``kept``, which speaks of the
# steps in it: the last complete one went with it too).
_GONE_KEPT = "nothing of it is intact: the steps saved in it went with it"
# torch.save's text for a write that failed below it (the errno is lost on the way).
_TORCH_WRITE_FAILED = re.compile(r"inline_container|PytorchStreamWriter|unexpected pos|"
                                 r"file write failed", re.I)
_LOW_SPACE_BYTES = 1 << 20


def disk_fault(e, directory):
    """(what happened, what to do) when ``e`` is a disk fault of writing into ``directory``.

    Only these are mapped: ENOSPC, EDQUOT, EROFS, EACCES/EPERM, and a directory that no longer
    exists; also torch.save's RuntimeError for a failed write when the file system is (nearly)
    full (``os.statvfs``). Anything else (a bug, an unexpected errno) returns None.
    """
    if isinstance(e, OSError):
        if e.errno == errno.ENOENT and not is_remote(directory) and not os.path.isdir(directory):
            return _GONE
        return _FAULTS.get(e.errno)
    if isinstance(e, RuntimeError) and _TORCH_WRITE_FAILED.search(str(e)):
        free = free_bytes(directory)
        if free is not None and free < _LOW_SPACE_BYTES:
            return _FAULTS[errno.ENOSPC]
    return None


def free_bytes(directory):
    """Bytes available to this user on the file system of a local ``directory``, else None."""
    if is_remote(directory):
        return None
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def fault_message(fault, directory, doing, kept, free_at_failure=None):
    """One line: "<dir>: <what happened> while <doing>[ (free space)]; <kept>; <what to do>".
    The free space is the one when the write failed (``free_at_failure``, measured before the
    partial files were removed), else the one now, said as such. For a log dir that is gone,
    ``kept`` gives way to _GONE_KEPT: nothing in it can be intact."""
    what, todo = fault
    if fault == _GONE:
        kept = _GONE_KEPT
    where = ""
    if fault in (_FAULTS[errno.ENOSPC], _FAULTS[errno.EDQUOT]):
        if free_at_failure is not None:
            where = f" (only {_human_bytes(free_at_failure)} free there when it failed)"
        else:
            free = free_bytes(directory)
            where = f" ({_human_bytes(free)} free there now)" if free is not None else ""
    return f"{directory}: {what} while {doing}{where}; {kept}; {todo}"


def _human_bytes(n):
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def write_fault_message(e, directory, doing, kept):
    """The one-line message for a write that failed with ``e`` in ``directory`` when it is a disk
    fault (full, quota, read-only, permission, vanished directory) or, for a directory in an
    object store, any other error of the store (write_failure_message: its answer),
    else None
    (a bug: re-raise). ``doing``: "saving step 6 (model000006.pt)"; ``kept``: what is left
    intact."""
    if is_remote(directory):
        said = write_failure_message(e, directory, doing, kept)
        if said is not None:
            return said
    if not isinstance(e, (OSError, RuntimeError)):
        return None
    fault = disk_fault(e, directory)
    return None if fault is None else fault_message(
        fault, directory, doing, kept, getattr(e, "free_bytes_at_failure", None))


def gone_message(directory, doing, kept):
    """The one-line message for a log dir that no longer exists (``kept`` gives way to what is
    true of a log dir that is gone: nothing of it is intact)."""
    return fault_message(_GONE, directory, doing, kept)
