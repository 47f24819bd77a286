"""Real object-store servers on 127.0.0.1 for the tests (issue 39), started and stopped by the
fixtures of test_object_store.py:

    moto's S3 server (`moto_server`, pip's moto[server])            s3://
    gcp-storage-emulator (pip)                                        gs://
    Azurite (npm; `make test` installs it into .stores/)              az://

``start(kind, tmp)`` returns a ``Store`` (its URL prefix, the environment variables that point a
client at it, ``make_bucket``, ``stop``) or raises ``Unavailable`` with the reason (a test then
skips with it). ``Proxy`` is a TCP proxy in front of a server that can answer HTTP 503 for a
while or refuse connections: the fault cases.
"""
import os
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
        from improved_diffusion.ckpt import storage
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
    """A TCP proxy on 127.0.0.1 in front of ``target_port``. ``fail_for(seconds)``: every
    request in that window is answered ``HTTP/1.1 503 Slow Down`` (S3's throttling answer) and
    the connection closed; ``down()``: connections refused from then on (the server gone)."""

    def __init__(self, target_port):
        self.target = target_port
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.fail_until = 0.0
        self.failed = 0
        self.forwarded = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def fail_for(self, seconds):
        self.fail_until = time.monotonic() + seconds

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

    def _serve(self, conn):
        if time.monotonic() < self.fail_until:
            try:
                conn.settimeout(2)
                conn.recv(65536)
                body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                conn.sendall(b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                             b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
            except OSError:
                pass
            finally:
                self.failed += 1
                conn.close()
            return
        self.forwarded += 1
        try:
            up = socket.create_connection(("127.0.0.1", self.target))
        except OSError:
            conn.close()
            return
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while True:
                data = a.recv(1 << 16)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
