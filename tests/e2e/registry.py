"""A local OCI registry on loopback, and images made without a Docker engine.

`crane registry serve` (github.com/google/go-containerregistry, built by the toolchain) keeps blobs under a
directory and listens on 127.0.0.1 only. Images are assembled with `crane append --oci-empty-base` from
layer tarballs the harness writes, then `crane mutate` sets the platform (an empty os/arch cannot be pulled
by containerd), entrypoint, cmd and user. Every helper returns a digest reference, `HOST/repo@sha256:...`.

    reg = Registry.start(tmp / "registry")
    layer = write_layer(tmp / "publish.tar", {"publish": FileEntry(source=path, mode=0o755)})
    ref = reg.push_layers("dispatch/publish", [layer])
    reg.stop()
"""

from __future__ import annotations

import csv
import io
import subprocess
import tarfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.e2e import toolchain
from tests.process import free_port, started_ready, stop


def _csv(items: list[str]) -> str:
    """crane's list flags are pflag string slices, parsed as one CSV record: quote what needs it."""
    out = io.StringIO()
    csv.writer(out, lineterminator="").writerow(items)
    return out.getvalue()


@dataclass(frozen=True)
class FileEntry:
    """One regular file in a layer: its bytes from `source` (a path) or `data`."""
    source: Path | None = None
    data: bytes | None = None
    mode: int = 0o644


@dataclass(frozen=True)
class Symlink:
    target: str


def write_layer(out: Path, entries: dict[str, FileEntry | Symlink], uid: int = 0) -> Path:
    """A reproducible layer tarball (fixed times and owners; parent directories made) from `entries`,
    keyed by the path inside the image without a leading slash."""
    dirs: set[str] = set()
    for path in entries:
        parts = path.strip("/").split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.add("/".join(parts[:i]))
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tar:
        for d in sorted(dirs):
            info = tarfile.TarInfo(d + "/")
            info.type, info.mode, info.mtime, info.uid, info.gid = tarfile.DIRTYPE, 0o755, 0, uid, uid
            tar.addfile(info)
        for path in sorted(entries):
            entry = entries[path]
            info = tarfile.TarInfo(path.strip("/"))
            info.mtime, info.uid, info.gid = 0, uid, uid
            if isinstance(entry, Symlink):
                info.type, info.linkname, info.mode = tarfile.SYMTYPE, entry.target, 0o777
                tar.addfile(info)
                continue
            data = entry.data if entry.data is not None else Path(entry.source).read_bytes()
            info.size, info.mode = len(data), entry.mode
            tar.addfile(info, io.BytesIO(data))
    return out


def busybox_layer(out: Path) -> Path:
    """Debian's busybox-static at /bin/busybox with every applet linked under /bin: a shell, cp, touch..."""
    toolchain.node_apt()
    busybox = Path("/bin/busybox")
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=True).stdout.split()
    entries: dict[str, FileEntry | Symlink] = {"bin/busybox": FileEntry(source=busybox, mode=0o755)}
    for name in applets:
        if name != "busybox" and "/" not in name:
            entries[f"bin/{name}"] = Symlink("busybox")
    entries["tmp/.keep"] = FileEntry(data=b"")
    return write_layer(out, entries)


class Registry:
    """`crane registry serve` on 127.0.0.1; stop() ends it."""

    def __init__(self, workdir: Path, proc: subprocess.Popen, port: int, log: Path):
        self.dir = workdir
        self.proc = proc
        self.port = port
        self.host = f"127.0.0.1:{port}"
        self.log = log
        self.crane = str(toolchain.crane_bin() / "crane")

    @classmethod
    def start(cls, workdir: Path, timeout: float = 30) -> Registry:
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "blobs").mkdir(exist_ok=True)
        crane = str(toolchain.crane_bin() / "crane")
        port = free_port()
        log = workdir / "registry.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([crane, "registry", "serve", "--address", f"127.0.0.1:{port}",
                                     "--disk", str(workdir / "blobs")], stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

        def serving() -> bool:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as r:
                return r.status == 200

        try:
            started_ready("crane registry serve", serving, timeout, proc, log, every=0.2)
        except AssertionError:
            stop(proc)
            raise
        return cls(workdir, proc, port, log)

    def stop(self) -> None:
        stop(self.proc)

    def _crane(self, *args: str) -> str:
        got = subprocess.run([self.crane, *args, "--insecure"], capture_output=True, text=True, timeout=300)
        if got.returncode != 0:
            raise RuntimeError(f"crane {' '.join(args)} failed ({got.returncode}):\n{got.stderr[-3000:]}")
        return got.stdout.strip()

    def crane_run(self, *args: str) -> str:
        """`crane ARGS` against this registry (a tag, a mutation, an append...): what it prints."""
        return self._crane(*args)

    def digest_ref(self, ref: str) -> str:
        """`HOST/repo:tag` (or a digest reference) as `HOST/repo@sha256:...`."""
        repo = ref.split("@")[0].rsplit(":", 1)[0] if ":" in ref.split("/")[-1] else ref.split("@")[0]
        return f"{repo}@{self._crane('digest', ref)}"

    def push_layers(self, repo: str, layers: list[Path], platform: str = "linux/amd64",
                    entrypoint: list[str] | None = None, cmd: list[str] | None = None, user: str | None = None,
                    env: dict[str, str] | None = None, workdir: str | None = None, tag: str = "e2e") -> str:
        """An image of `layers` (bottom first) on an empty OCI base, pushed as HOST/repo:tag; returns its
        digest reference."""
        ref = f"{self.host}/{repo}:{tag}"
        args = ["append", "--oci-empty-base", "-t", ref]
        for layer in layers:
            args += ["-f", str(layer)]
        self._crane(*args)
        mutate = ["mutate", ref, "-t", ref, "--set-platform", platform]
        if entrypoint is not None:
            mutate.append("--entrypoint=" + _csv(entrypoint))
        if cmd is not None:
            mutate.append("--cmd=" + _csv(cmd))
        if user is not None:
            mutate += ["--user", user]
        if workdir is not None:
            mutate += ["--workdir", workdir]
        for key, value in (env or {}).items():
            mutate += ["--env", f"{key}={value}"]
        self._crane(*mutate)
        return self.digest_ref(ref)

    def push_oci_layout(self, repo: str, layout: Path, tag: str = "e2e") -> str:
        """An OCI image layout directory (one image, e.g. what BuildKit exports) pushed as HOST/repo:tag;
        returns its digest reference."""
        ref = f"{self.host}/{repo}:{tag}"
        self._crane("push", str(layout), ref)
        return self.digest_ref(ref)

    def push_index(self, repo: str, manifests: list[str], tag: str = "e2e") -> str:
        """An OCI image index of `manifests` (digest references of images; each one's platform from its config)
        pushed as HOST/repo:tag; returns its digest reference."""
        ref = f"{self.host}/{repo}:{tag}"
        self._crane("index", "append", *(arg for m in manifests for arg in ("-m", m)), "-t", ref)
        return self.digest_ref(ref)

    def push_tarball(self, repo: str, tarball: Path, tag: str = "e2e") -> str:
        """A `docker save`-style or OCI tarball pushed as HOST/repo:tag; returns its digest reference."""
        ref = f"{self.host}/{repo}:{tag}"
        self._crane("push", str(tarball), ref)
        return self.digest_ref(ref)

    def config(self, ref: str) -> dict:
        import json

        return json.loads(self._crane("config", ref))

    def manifest(self, ref: str) -> dict:
        """The manifest `ref` names: an image's, or an image index (a multi-platform image, or BuildKit's
        image with its attestations)."""
        import json

        return json.loads(self._crane("manifest", ref))

    def blob(self, ref: str, digest: str) -> bytes:
        """A blob of `ref`'s repository by digest."""
        got = subprocess.run([self.crane, "blob", f"{ref.split('@')[0]}@{digest}", "--insecure"],
                             capture_output=True, timeout=300)
        if got.returncode != 0:
            raise RuntimeError(f"crane blob {digest} failed ({got.returncode}):\n{got.stderr.decode()[-3000:]}")
        return got.stdout
