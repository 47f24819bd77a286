"""Real object-store servers on 127.0.0.1 for the tests (issue 39), started and stopped by the
fixtures of test_object_store.py:

    moto's S3 server (`moto_server`, pip's moto[server])            s3://
    gcp-storage-emulator (pip)                                        gs://
    Azurite (npm; `make test` installs it into .stores/)              az://

``start(kind, tmp)`` returns a ``Store`` (its URL prefix, the environment variables that point a
client at it, ``make_bucket``, ``stop``) or raises ``Unavailable`` with the reason (a test then
skips with it). ``Proxy`` is an HTTP proxy in front of a server that counts the requests (and the bytes it
relays back) and can answer a store's error (503 SlowDown: throttling) to a number of requests or
from some request on, or refuse connections: the fault cases. Faults count requests, never
seconds: a loaded machine meets the same fault.
"""
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import cluster_sim

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
AZURITE = REPO / ".stores" / "node_modules" / ".bin" / "azurite-blob"
# Azurite's fixed development account (public, documented by Microsoft).
AZ_ACCOUNT = "devstoreaccount1"
AZ_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==")


class Unavailable(Exception):
    """The server cannot be started here (the message says why)."""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_port(port, proc, timeout=30.0):
    end = time.monotonic() + cluster_sim.hang_s(timeout)
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise Unavailable(f"the server exited with {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            time.sleep(0.1)
    raise Unavailable(f"no answer on port {port} after {cluster_sim.hang_s(timeout):.0f} s")


class Store:
    """One running server: ``scheme`` ("s3", "gs", "az"), ``env`` (the client's variables),
    ``port``."""

    def __init__(self, scheme, proc, port, env):
        self.scheme, self.proc, self.port, self.env = scheme, proc, port, env

    def env_with(self, port=None):
        """The client's environment, pointed at ``port`` (a proxy) instead of the server."""
        env = dict(self.env)
        if port is not None:
            for k, v in env.items():
                env[k] = v.replace(f":{self.port}", f":{port}")
        return env

    def client(self):
        """A storage-layer view of this server in this process (env set while it runs)."""
        os.environ.update(self.env)
        from improved_diffusion.infra import storage
        storage.forget_clients()
        return storage

    def make_bucket(self, name):
        storage = self.client()
        fs, _ = storage.filesystem(f"{self.scheme}://{name}")
        fs.mkdir(name)
        return f"{self.scheme}://{name}"

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start(kind, tmp):
    tmp = Path(tmp)
    port = free_port()
    log = open(tmp / f"{kind}-server.log", "wb")
    if kind == "s3":
        exe = BIN / "moto_server"
        if not exe.exists():
            raise Unavailable("moto_server is not installed (pip install 'moto[server]')")
        cmd = [str(exe), "-H", "127.0.0.1", "-p", str(port)]
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test",
               "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    elif kind == "gs":
        exe = BIN / "gcp-storage-emulator"
        if not exe.exists():
            raise Unavailable("gcp-storage-emulator is not installed (pip install "
                              "gcp-storage-emulator)")
        cmd = [str(exe), "start", "--host", "127.0.0.1", "--port", str(port), "--in-memory"]
        env = {"STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{port}",
               "GOOGLE_CLOUD_PROJECT": "test"}
    elif kind == "az":
        if not AZURITE.exists():
            raise Unavailable(f"Azurite is not installed ({AZURITE}; make test installs it with "
                              f"npm, which needs node)")
        if shutil.which("node") is None:
            raise Unavailable("node is not on PATH (Azurite runs on it)")
        cmd = [str(AZURITE), "--blobHost", "127.0.0.1", "--blobPort", str(port), "--location",
               str(tmp / "azurite"), "--silent", "--skipApiVersionCheck", "--loose"]
        env = {"AZURE_STORAGE_CONNECTION_STRING": (
            f"DefaultEndpointsProtocol=http;AccountName={AZ_ACCOUNT};AccountKey={AZ_KEY};"
            f"BlobEndpoint=http://127.0.0.1:{port}/{AZ_ACCOUNT};")}
    else:
        raise ValueError(kind)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(tmp),
                            start_new_session=True)
    try:
        _wait_port(port, proc)
    except Unavailable:
        proc.kill()
        proc.wait()
        raise
    return Store(kind, proc, port, env)


class Proxy:
    """An HTTP/1.1 proxy on 127.0.0.1 in front of ``target_port``, one request at a time: each
    request a client sends (on a kept-alive connection too) is read whole, counted
    (``requests``: its request lines) and forwarded on a connection of its own (``relayed``:
    the bytes of the server's answers, headers included), unless a fault answers it (then the
    client's connection is closed after the answer):

    * ``answer(status, code, message, after=None, times=None)``: every request from now on
      (``after``: from the first request whose line matches that regular expression on, that
      request included; ``times``: that many requests only) is answered ``status`` with the
      store's error ``code`` and ``message`` in S3's XML (and Azure's x-ms-error-code header),
      counted in ``failed``; ``heal()`` stops it;
    * ``down()``: connections refused from then on (the server gone).
    """

    def __init__(self, target_port):
        self.target = target_port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.failed = 0
        self.forwarded = 0
        self.relayed = 0  # bytes of the server's answers passed on to the clients
        self.requests = []  # every request line seen, in order
        self._fault = None  # (status, code, message) answered to every request
        self._after = None  # the pattern of the request line that switches _fault on
        self._times = None  # how many requests _fault answers (None: every one)
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def answer(self, status, code, message, after=None, times=None):
        with self._lock:
            self._fault, self._after, self._times = (status, code, message), after, times

    def heal(self):
        with self._lock:
            self._fault, self._after, self._times = None, None, None

    def down(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _fault_for(self, line):
        with self._lock:
            self.requests.append(line)
            fault = self._fault
            if fault is not None and self._after is not None:
                if not re.search(self._after, line):
                    return None
                self._after = None  # on from here
            if fault is not None and self._times is not None:
                self._times -= 1
                if self._times <= 0:
                    self._fault = self._times = None
            if fault is not None:
                self.failed += 1  # before the answer: a client that has it sees the count
            return fault

    def _serve(self, conn):
        reader = conn.makefile("rb")
        try:
            while True:
                head = _read_head(reader)
                if head is None:
                    return
                line = head.split(b"\r\n", 1)[0].decode("latin-1")
                headers = _headers(head)
                fault = self._fault_for(line)
                if fault is not None:
                    status, code, message = fault
                    body = (f"<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>"
                            f"<Message>{message}</Message></Error>").encode()
                    conn.sendall(b"HTTP/1.1 %d %s\r\nContent-Type: application/xml\r\n"
                                 b"x-ms-error-code: %s\r\nConnection: close\r\n"
                                 b"Content-Length: %d\r\n\r\n"
                                 % (status, code.encode(), code.encode(), len(body))
                                 + (b"" if line.startswith("HEAD ") else body))
                    return
                if headers.get(b"expect", b"").lower() == b"100-continue":
                    conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                body = _read_body(reader, headers)
                with self._lock:
                    self.forwarded += 1  # (counted before the answer, as ``failed``)
                try:
                    up = socket.create_connection(("127.0.0.1", self.target))
                except OSError:
                    return
                with up:
                    up.sendall(_without(head, (b"expect", b"connection"), b"Connection: close")
                               + body)
                    while True:  # the answer, until the server closes (Connection: close)
                        data = up.recv(1 << 16)
                        if not data:
                            break
                        with self._lock:
                            self.relayed += len(data)
                        conn.sendall(data)
                return  # the answer may say keep-alive: the client finds this one closed
        except OSError:
            return
        finally:
            reader.close()
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            conn.close()


def _read_head(reader):
    """A request's line and headers (bytes up to the blank line), or None at the end."""
    head = b""
    while not head.endswith(b"\r\n\r\n"):
        line = reader.readline(65536)
        if not line:
            return None
        if head == b"" and line in (b"\r\n", b"\n"):
            continue
        head += line
    return head


def _headers(head):
    out = {}
    for raw in head.split(b"\r\n")[1:]:
        if b":" in raw:
            k, v = raw.split(b":", 1)
            out[k.strip().lower()] = v.strip()
    return out


def _read_body(reader, headers):
    """The request's body as sent (Content-Length, or chunked with its framing)."""
    if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
        out = b""
        while True:
            size_line = reader.readline()
            out += size_line
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    t = reader.readline()
                    out += t
                    if t in (b"\r\n", b"\n", b""):
                        return out
            out += reader.read(size + 2)
    n = int(headers.get(b"content-length", b"0") or 0)
    return reader.read(n) if n else b""


def _without(head, names, extra):
    """``head`` without the headers ``names`` (lowercase), ``extra`` added."""
    lines = head.rstrip(b"\r\n").split(b"\r\n")
    kept = [lines[0]] + [ln for ln in lines[1:]
                         if ln.split(b":", 1)[0].strip().lower() not in names]
    return b"\r\n".join(kept + [extra]) + b"\r\n\r\n"
