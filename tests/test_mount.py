"""`modelfs mount` through real FUSE mounts: paths, bytes, readers, live changes, failure."""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import gguf
import pytest
from safetensors import safe_open

from modelfs.demo import build_demo_store
from modelfs.fsd.builder import short_path
from modelfs.fsd.mount import mount_points
from modelfs.store.digest import Digest
from modelfs.store.names import parse_name
from modelfs.store.scan import scan_store
from modelfs.store.tools.files import model_files
from tests.builders import TinyStore
from tests.mounting import MODELFS, force_unmount, fuse, mounted, wait_for_mount

pytestmark = fuse


@pytest.fixture(scope="module")
def demo_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("demo") / "models"
    build_demo_store(root)
    return root


@pytest.fixture(scope="module")
def demo_mnt(demo_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    mnt = tmp_path_factory.mktemp("mnt")
    with mounted(demo_root, mnt):
        yield mnt


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def wait_until(check, timeout: float = 2.5) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return True
        except OSError:
            pass  # a name the kernel has not yet been told is stale
        time.sleep(0.05)
    return bool(check())


def test_every_file_by_path_has_its_digest(demo_root: Path, demo_mnt: Path) -> None:
    index = scan_store(demo_root)
    checked = 0
    for entry in index:
        dirs = [("/".join(short_path(entry.name)), entry.preferred())]
        for v in entry.variants:
            if v.from_list:
                dirs.append(("/".join(short_path(entry.name)) + f"@{v.runner}", v))
        for d, variant in dirs:
            assert variant is not None
            for f in model_files(variant.manifest):
                assert sha256(demo_mnt / d / f.path) == f.layer.digest.hex, (d, f.path)
                assert (demo_mnt / d / f.path).stat().st_size == f.layer.size
                checked += 1
            meta = demo_mnt / d / ".ollama"
            assert (meta / "manifest.json").read_bytes() == variant.manifest.raw
            assert (meta / "digest").read_text() == f"{variant.manifest.digest}\n"
            assert (meta / "status").read_text() == "ok\n"
            assert variant.manifest.config is not None
            assert sha256(meta / "config.json") == variant.manifest.config.digest.hex
            canonical = "/".join(entry.name.legacy_parts())
            assert (demo_mnt / ".by-name" / canonical / "Modelfile").is_file()
            digest_dir = demo_mnt / ".by-digest" / variant.manifest.digest.hex
            assert (digest_dir / ".ollama" / "manifest.json").read_bytes() == variant.manifest.raw
    assert checked > 20
    blobs = sorted(p.name for p in (demo_mnt / ".blobs").iterdir())
    assert blobs == sorted(index.blob_names)
    for name in blobs[:50]:
        assert sha256(demo_mnt / ".blobs" / name) == Digest.parse(name).hex


def test_paths_of_the_contract(demo_mnt: Path) -> None:
    gemma = demo_mnt / "gemma4" / "26b"
    assert {"model.gguf", "mmproj.gguf", "draft.gguf", "LICENSE", "Modelfile"} <= set(
        os.listdir(gemma)
    )
    assert "FROM ./model.gguf" in (gemma / "Modelfile").read_text()
    assert (demo_mnt / "gemma4" / "26b@llamacpp" / "model.gguf").is_file()
    mlx = demo_mnt / "gemma4" / "26b@mlx"
    assert (mlx / "config.json").is_file() and (mlx / "draft" / "config.json").is_file()
    assert any(p.suffix == ".safetensors" for p in (mlx / "tensors").iterdir())
    assert (demo_mnt / "someuser" / "tiny" / "q8" / "model.gguf").is_file()
    hf = demo_mnt / "hf.co" / "bartowski" / "SmolLM2-135M-Instruct-GGUF" / "Q4_K_M"
    assert (hf / "model.gguf").is_file()
    st = os.stat(gemma / "model.gguf")
    assert oct(st.st_mode & 0o777) == "0o444" and oct(os.stat(gemma).st_mode & 0o777) == "0o555"


def test_real_readers_on_mounted_files(demo_mnt: Path) -> None:
    reader = gguf.GGUFReader(demo_mnt / "gemma4" / "26b" / "model.gguf")
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "gemma4"
    assert len(reader.tensors) > 5
    mlx = demo_mnt / "gemma4" / "26b@mlx"
    merged_path = mlx / "model.safetensors"
    with safe_open(merged_path, "numpy") as merged:
        merged_keys = set(merged.keys())
        seen = set()
        for part in sorted((mlx / "tensors").iterdir()):
            with safe_open(part, "numpy") as f:
                for k in f.keys():  # noqa: SIM118 (safe_open is no dict)
                    seen.add(k)
                    dtype = f.get_slice(k).get_dtype()
                    assert merged.get_slice(k).get_dtype() == dtype
                    assert merged.get_slice(k).get_shape() == f.get_slice(k).get_shape()
                    if dtype != "BF16":  # numpy has no bfloat16; checked by bytes below
                        assert merged.get_tensor(k).tobytes() == f.get_tensor(k).tobytes()
        assert seen == merged_keys

    # Every tensor's bytes, BF16 included, located by each file's own header.
    def tensors(path: Path) -> dict[str, bytes]:
        raw = path.read_bytes()
        n = int.from_bytes(raw[:8], "little")
        header = json.loads(raw[8 : 8 + n])
        header.pop("__metadata__", None)
        return {k: raw[8 + n + v["data_offsets"][0] : 8 + n + v["data_offsets"][1]]
                for k, v in header.items()}  # fmt: skip

    whole = tensors(merged_path)
    for part in (mlx / "tensors").iterdir():
        for k, data in tensors(part).items():
            assert whole[k] == data


def test_cp_du_xattrs_mmap_odirect_and_erofs(demo_mnt: Path, tmp_path: Path) -> None:
    src = demo_mnt / "qwen3" / "0.6b"
    shutil.copytree(src, tmp_path / "copy")
    for f in src.rglob("*"):
        if f.is_file():
            assert (tmp_path / "copy" / f.relative_to(src)).read_bytes() == f.read_bytes()
    du = subprocess.run(["du", "-sb", str(src)], capture_output=True, text=True, check=True)
    assert int(du.stdout.split()[0]) >= (src / "model.gguf").stat().st_size

    model = src / "model.gguf"
    assert os.getxattr(model, "user.modelfs.digest").decode().startswith("sha256:")
    assert os.getxattr(model, "user.modelfs.media_type") == b"application/vnd.ollama.image.model"
    assert os.getxattr(model, "user.modelfs.gguf.file_type") == b"Q8_0"
    assert os.getxattr(model, "user.modelfs.gguf.architecture")
    assert int(os.getxattr(model, "user.modelfs.gguf.parameter_count")) > 0
    assert os.getxattr(src, "user.modelfs.name") == b"registry.ollama.ai/library/qwen3:0.6b"
    assert os.getxattr(src, "user.modelfs.manifest_digest").startswith(b"sha256:")
    with pytest.raises(OSError) as info:
        os.getxattr(model, "user.nope")
    assert info.value.errno == errno.ENODATA
    # Namespaces the mount has no use for are unsupported, not merely empty: `ls -l` then
    # stops asking for them (one round trip per device instead of three per entry).
    for name in ("security.selinux", "system.posix_acl_access", "trusted.x"):
        for path in (model, src):
            with pytest.raises(OSError) as info:
                os.getxattr(path, name)
            assert info.value.errno == errno.EOPNOTSUPP, name
    listing = subprocess.run(["ls", "-lR", str(src)], capture_output=True, text=True)
    assert listing.returncode == 0, listing.stderr
    assert "model.gguf" in listing.stdout

    data = model.read_bytes()
    with open(model, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert m[:] == data
    try:
        fd = os.open(model, os.O_RDONLY | os.O_DIRECT)
    except OSError as exc:
        assert exc.errno == errno.EINVAL
    else:
        try:
            buf = mmap.mmap(-1, 1 << 20)
            n = os.readv(fd, [buf])
            assert buf[:n] == data[:n]
        finally:
            os.close(fd)

    for attempt in (
        lambda: os.open(model, os.O_RDWR),
        lambda: os.open(src / "new", os.O_WRONLY | os.O_CREAT),
        lambda: os.unlink(model),
        lambda: os.rename(model, src / "x"),
        lambda: os.mkdir(src / "d"),
        lambda: os.setxattr(model, "user.x", b"1"),
        lambda: os.truncate(model, 0),
        lambda: os.chmod(model, 0o644),
    ):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno in (errno.EROFS, errno.EACCES), attempt


def test_statfs_is_the_stores(demo_root: Path, demo_mnt: Path) -> None:
    a, b = os.statvfs(demo_root), os.statvfs(demo_mnt)
    assert (a.f_blocks, a.f_bsize) == (b.f_blocks, b.f_bsize)


def test_live_changes_and_open_file_keeps_its_bytes(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    old_weights = b"old weights " * 10000
    tiny.gguf_model("m:1", payload=old_weights)
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        # Opened, not read: nothing of it is in the page cache when its blob goes.
        f = open(mnt / "m" / "1" / "model.gguf", "rb")  # noqa: SIM115
        try:
            # A pull of a new model shows within 2 s.
            tiny.gguf_model("new:1", payload=b"new model")
            assert wait_until(lambda: (mnt / "new" / "1" / "model.gguf").exists())
            # A re-tag to new weights, and the old blob collected, while the file is open.
            new_weights = b"new weights " * 10000
            tiny.gguf_model("m:1", payload=new_weights)
            old_blob = tiny.layout.blob(Digest.of_bytes(old_weights))
            old_blob.unlink()
            assert wait_until(lambda: (mnt / "m" / "1" / "model.gguf").read_bytes() == new_weights)
            assert f.read() == old_weights
        finally:
            f.close()
        # `ollama rm` shows within 2 s.
        tiny.layout.legacy_manifest(parse_name("new:1")).unlink()
        assert wait_until(lambda: not (mnt / "new" / "1").exists())
        assert "new" not in os.listdir(mnt)


def test_missing_blob_and_hostile_store(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    raw = tiny.gguf_model("ok:1")
    lic = Digest.parse(json.loads(raw)["layers"][2]["digest"])
    tiny.gguf_model("broken:1", payload=b"broken weights")
    tiny.layout.blob(lic).unlink()  # shared by both models
    lib = tiny.layout.manifests / "registry.ollama.ai" / "library"
    (lib / ".DS_Store").write_bytes(b"junk")
    (lib / "zero").mkdir()
    (lib / "zero" / "latest").write_bytes(b"")
    v2 = tiny.layout.manifests_v2 / "ollama.com" / "library" / "evil"
    v2.mkdir(parents=True)
    (v2 / "passwd").symlink_to("/etc/passwd")
    evil_blob = tiny.layout.blobs / f"sha256-{'ab' * 32}"
    evil_blob.symlink_to("/etc/passwd")
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt):
        names = set(os.listdir(mnt / "ok" / "1"))
        assert "model.gguf" in names and "LICENSE" not in names
        status = (mnt / "ok" / "1" / ".ollama" / "status").read_text()
        assert status == f"missing blob {lic} (LICENSE)\n"
        assert sorted(os.listdir(mnt)) == [
            ".blobs",
            ".by-digest",
            ".by-name",
            ".huggingface",
            ".lmstudio",
            "broken",
            "ok",
        ]
        assert evil_blob.name not in os.listdir(mnt / ".blobs")
        assert not (mnt / ".blobs" / evil_blob.name).exists()
        for p in mnt.rglob("*"):
            if p.is_file():
                assert b"root:x:0:0" not in p.read_bytes()


def test_symlink_data_mode(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("m:1", payload=b"weights")
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt, "--data", "symlink"):
        link = mnt / "m" / "1" / "model.gguf"
        assert link.is_symlink()
        assert Path(os.readlink(link)) == tiny.layout.blob(Digest.of_bytes(b"weights"))
        assert link.read_bytes() == b"weights"


def test_sigterm_umount_and_kill_9(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("m:1")
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt) as proc:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        assert not os.path.ismount(mnt)

    mnt.mkdir(exist_ok=True)
    proc = subprocess.Popen([MODELFS, "mount", "--store", str(tiny.root), str(mnt)])
    try:
        wait_for_mount(proc, mnt)
        done = subprocess.run([MODELFS, "umount", str(mnt)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert proc.wait(timeout=10) == 0
        done = subprocess.run([MODELFS, "umount", str(mnt)], capture_output=True, text=True)
        assert done.returncode == 1 and done.stderr.count("\n") == 1
        assert "modelfs: error: " in done.stderr and "not a mount point" in done.stderr

        proc = subprocess.Popen([MODELFS, "mount", "--store", str(tiny.root), str(mnt)])
        wait_for_mount(proc, mnt)
        proc.kill()
        proc.wait()
        with pytest.raises(OSError) as info:
            os.listdir(mnt)
        assert info.value.errno == errno.ENOTCONN  # never an empty directory
    finally:
        if proc.poll() is None:
            proc.kill()
        force_unmount(mnt)


def test_mount_errors_are_one_line(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    done = subprocess.run(
        [MODELFS, "mount", "--store", str(tiny.root), str(tmp_path / "absent")],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("modelfs: error: mount point")
    assert "Traceback" not in done.stderr


def test_a_vanished_store_keeps_the_last_view(tmp_path: Path) -> None:
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("m:1", payload=b"weights")
    mnt = tmp_path / "mnt"
    with mounted(tiny.root, mnt) as proc:
        tiny.root.rename(tmp_path / "gone")
        time.sleep(2.5)
        assert "m" in os.listdir(mnt)  # never an empty tree
        try:
            os.statvfs(mnt)
        except OSError as exc:
            assert exc.errno == errno.EIO
        assert proc.poll() is None  # the daemon survived it
        assert os.path.ismount(mnt)
        (tmp_path / "gone").rename(tiny.root)
        tiny.gguf_model("n:1", payload=b"more")
        assert wait_until(lambda: "n" in os.listdir(mnt), timeout=4)


def test_sighup_rescans_what_the_change_detection_cannot_see(tmp_path: Path) -> None:
    """The change detection looks at the manifests trees and blobs/ itself, not at the bytes
    of each blob: a blob edited in place (never done by Ollama, which renames a whole blob in)
    is what SIGHUP is for. (A tag rewritten in place with its size and mtime put back is seen:
    its ctime moves; tests/test_tree.py.)"""
    tiny = TinyStore(tmp_path / "models")
    tiny.gguf_model("m:1", payload=b"weights A")
    template = tiny.layout.blob(Digest.of_bytes(b"{{ .Prompt }}"))
    st = template.stat()
    mnt = tmp_path / "mnt"
    # Settled: a store changed within the racy margin (2 s) of a mount's start is scanned
    # again at the first look after it, in case the start's scan missed the change.
    time.sleep(2.1)
    with mounted(tiny.root, mnt) as proc:
        modelfile = mnt / "m" / "1" / "Modelfile"
        assert b"{{ .Prompt }}" in modelfile.read_bytes()
        with open(template, "r+b") as f:
            f.write(b"{{ .Suffix }}")  # the same size
        os.utime(template, ns=(st.st_atime_ns, st.st_mtime_ns))
        time.sleep(1.5)
        assert b"{{ .Prompt }}" in modelfile.read_bytes()  # not seen: that is what SIGHUP is for
        proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: b"{{ .Suffix }}" in modelfile.read_bytes())


def test_root_unmounts_a_mount_another_user_made(tmp_path: Path) -> None:
    """A mount `nobody` made without allow_other refuses root's lstat (EACCES), so a stat
    cannot see it is a mount point; `modelfs umount` asks the kernel's mount table, and root
    may unmount anyone's. A dead one (kill -9, ENOTCONN) is still a mount point to it."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to mount as another user")
    nobody = pwd.getpwnam("nobody")
    # pytest's tmp_path is root's alone; nobody needs to read the store and own the mount point.
    shared = Path(tempfile.mkdtemp(prefix="modelfs-nobody-"))
    # Debian makes /dev/fuse 0666; a container may give root alone access. Opened up for the
    # test and put back as it was.
    fuse_mode = os.stat("/dev/fuse").st_mode & 0o777
    try:
        os.chmod("/dev/fuse", fuse_mode | 0o666)
        shared.chmod(0o755)
        tiny = TinyStore(shared / "models")
        tiny.gguf_model("m:1")
        subprocess.run(["chmod", "-R", "a+rX", str(shared)], check=True)
        as_nobody = [
            "setpriv",
            f"--reuid={nobody.pw_uid}",
            f"--regid={nobody.pw_gid}",
            "--clear-groups",
        ]
        for dead in (False, True):
            mnt = shared / f"mnt-{dead}"
            mnt.mkdir()
            os.chown(mnt, nobody.pw_uid, nobody.pw_gid)
            proc = subprocess.Popen(
                [*as_nobody, MODELFS, "mount", "--store", str(tiny.root), str(mnt)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env={**os.environ, "HOME": "/nonexistent"},
            )
            try:
                deadline = time.monotonic() + 15
                while str(mnt) not in mount_points():
                    assert proc.poll() is None, proc.stdout.read() if proc.stdout else b""
                    assert time.monotonic() < deadline, "nobody's mount did not come up"
                    time.sleep(0.05)
                assert not os.path.ismount(mnt)  # what a stat-based check concluded
                if dead:
                    proc.kill()
                    proc.wait()
                done = subprocess.run([MODELFS, "umount", str(mnt)], capture_output=True, text=True)
                assert done.returncode == 0, done.stderr
                assert str(mnt) not in mount_points()
                if not dead:
                    assert proc.wait(timeout=10) == 0
            finally:
                if proc.poll() is None:
                    proc.kill()
                proc.wait()
                force_unmount(mnt)
    finally:
        os.chmod("/dev/fuse", fuse_mode)
        shutil.rmtree(shared, ignore_errors=True)
