"""Give a Python environment a pyfuse3 that can use FUSE passthrough (kernel >= 6.9).

    python -m modelfs build-passthrough [--venv DIR] [--jobs 2] [--force]
    scripts/build-passthrough [--venv .venv] [--jobs 2] [--force]

The first builds into the environment that python runs (a venv, pipx's, a system Python); the
second, from a checkout, into its .venv.

With passthrough, reads and mmap of a blob-backed file go from the kernel straight to the
blob: no daemon round trip, and the blob's own page cache (large folios) instead of a second
copy in 4 KiB pages. pyfuse3 3.5.0 has no API for it and Debian 12's libfuse 3.14 cannot
negotiate it, so this script

  1. builds libfuse 3.17.2 (Debian's orig tarball, sha256-pinned) into a private prefix,
     VENV/opt/libfuse-3.17.2: the library only (soname libfuse3.so.4), no fusermount3, no
     udev rules; the system's libfuse3 and fusermount3 stay as they are (mounting as a
     user still goes through the system's setuid fusermount3);
  2. builds pyfuse3 3.5.0 from its sdist (sha256-pinned) against that prefix, with an rpath
     to it and four small additions of ours (see `patch_pyfuse3`), and installs it into VENV
     as version 3.5.0+passthrough1.

Build tools (meson, ninja, Cython, setuptools) come pinned from PyPI into a throwaway venv
under VENV/opt/build-passthrough, which also keeps the downloads. Running the script again
does nothing when the result is in place; --force rebuilds both. Needs a C compiler and
pkg-config (Debian: gcc, pkg-config) and network access to deb.debian.org and PyPI.

fsd uses passthrough only where the kernel grants it: the patched pyfuse3, a kernel with
CONFIG_FUSE_PASSTHROUGH, and CAP_SYS_ADMIN in the mount's process (FUSE_DEV_IOC_BACKING_OPEN
requires it). Anything less and the mount serves reads itself, as before.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
from pathlib import Path

from modelfs.store.digest import sha256_stream

LIBFUSE_VERSION = "3.17.2"
LIBFUSE_URL = "https://deb.debian.org/debian/pool/main/f/fuse3/fuse3_3.17.2.orig.tar.gz"
LIBFUSE_SHA256 = "3d932431ad94e86179e5265cddde1d67aa3bb2fb09a5bd35c641f86f2b5ed06f"
PYFUSE3_VERSION = "3.5.0"
PYFUSE3_SDIST = "pyfuse3-3.5.0.tar.gz"
PYFUSE3_SHA256 = "88399a9494b88603230bba300f4ba9ad63fece5ed514ca3633d555a0c6a42b24"
# The local label marks our build; bump the number whenever patch_pyfuse3 changes.
PYFUSE3_BUILD = "3.5.0+passthrough1"
TOOLS = [
    "meson==1.12.1",
    "ninja==1.13.2",
    "Cython==3.3.1",
    "setuptools==84.2.1",
    "setuptools-scm==10.3.4",
    "wheel==0.48.0",
]
MARK = "# modelfs passthrough"


def log(msg: str) -> None:
    print(f"build-passthrough: {msg}", file=sys.stderr, flush=True)


def run(argv: list[str | Path], **kw: object) -> None:
    subprocess.run([str(a) for a in argv], check=True, **kw)  # type: ignore[call-overload]


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return sha256_stream(f)


def verified(path: Path, expected: str) -> bool:
    """Whether `path` is there; a file with another sha256 is removed and is an error."""
    if not path.is_file():
        return False
    got = sha256(path)
    if got != expected:
        path.unlink()
        raise SystemExit(f"build-passthrough: {path.name}: sha256 {got}, expected {expected}")
    return True


def unpack(tarball: Path, dest: Path) -> Path:
    """Unpack afresh into dest; return the single top-level directory."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    with tarfile.open(tarball) as t:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.11.4
            t.extractall(dest, filter="data")
        else:
            t.extractall(dest)
    (top,) = dest.iterdir()
    return top


# -- pyfuse3: our additions ---------------------------------------------------------------------
def _edit(path: Path, anchor: str, text: str, where: str) -> None:
    src = path.read_text()
    if src.count(anchor) != 1:
        raise SystemExit(
            f"build-passthrough: {path}: anchor {anchor!r} found {src.count(anchor)} times, "
            "expected once (not pyfuse3 3.5.0?)"
        )
    i = src.index(anchor)
    j = i + len(anchor)
    src = {
        "after": src[:j] + text + src[j:],
        "before": src[:i] + text + src[i:],
        "replace": src[:i] + text + src[j:],
    }[where]
    path.write_text(src)


def patch_pyfuse3(root: Path) -> None:
    """Add to an unpacked pyfuse3 3.5.0 (needs libfuse >= 3.17 headers):

    - `FileInfo(backing_id=0)`: a positive id makes the open reply FOPEN_PASSTHROUGH, so the
      kernel serves read, splice and mmap of that open file from the backing file;
    - `Operations.enable_passthrough` (read with getattr at INIT): ask for
      FUSE_CAP_PASSTHROUGH, with `Operations.passthrough_stack_depth` (default 1) as libfuse's
      max_backing_stack_depth (1: backing files may sit on overlayfs; nothing can stack on
      top of the mount);
    - `pyfuse3.passthrough_negotiated()`: whether INIT granted it;
    - `pyfuse3.backing_open(fd) -> id` and `pyfuse3.backing_close(id)`: the
      FUSE_DEV_IOC_BACKING_OPEN/CLOSE ioctls on the session's /dev/fuse fd. libfuse's
      fuse_passthrough_open does the same but needs a request, logs to stderr and loses
      errno; these raise OSError (EPERM: no CAP_SYS_ADMIN, or passthrough not granted).

    Each edit is placed by a short anchor that must occur exactly once.
    """
    pyx = root / "src/pyfuse3/__init__.pyx"
    if MARK in pyx.read_text():
        return
    for rel, where, anchor, text in EDITS:
        _edit(root / rel, anchor, text, where)
    with pyx.open("a") as f:
        f.write(PYX_TEXT)
    with (root / "src/pyfuse3/__init__.pyi").open("a") as f:
        f.write(PYI_TEXT)


INIT_TEXT = f"""\
    global _passthrough_negotiated  {MARK}
    if (getattr(operations, 'enable_passthrough', False) and
            conn.capable & FUSE_CAP_PASSTHROUGH):
        conn.want |= FUSE_CAP_PASSTHROUGH
        conn.max_backing_stack_depth = getattr(operations, 'passthrough_stack_depth', 1)
        _passthrough_negotiated = True

"""

PYX_TEXT = f'''

{MARK}
cdef extern from *:
    """
    #include <stdint.h>
    #include <sys/ioctl.h>
    struct modelfs_backing_map {{ int32_t fd; uint32_t flags; uint64_t padding; }};
    #define MODELFS_IOC_BACKING_OPEN _IOW(229, 1, struct modelfs_backing_map)
    #define MODELFS_IOC_BACKING_CLOSE _IOW(229, 2, uint32_t)
    """
    struct modelfs_backing_map:
        int fd
        unsigned flags
        unsigned long long padding
    unsigned long MODELFS_IOC_BACKING_OPEN
    unsigned long MODELFS_IOC_BACKING_CLOSE
    int ioctl(int fd, unsigned long request, ...)

cdef bint _passthrough_negotiated = False


def passthrough_negotiated():
    """True once the kernel granted FUSE passthrough at INIT."""
    return _passthrough_negotiated


def backing_open(int fd):
    """Register the open file *fd* as a backing file; return its id (for FileInfo.backing_id)."""
    cdef modelfs_backing_map m
    cdef int ret
    m.fd = fd
    m.flags = 0
    m.padding = 0
    ret = ioctl(session_fd, MODELFS_IOC_BACKING_OPEN, &m)
    if ret < 0:
        raise OSError(errno.errno, os.strerror(errno.errno))
    if ret == 0:
        raise OSError(errno.EIO, "backing id 0")
    return ret


def backing_close(int backing_id):
    """Drop a backing id; files opened with it keep their backing file."""
    cdef uint32_t bid = <uint32_t> backing_id
    if ioctl(session_fd, MODELFS_IOC_BACKING_CLOSE, &bid) < 0:
        raise OSError(errno.errno, os.strerror(errno.errno))
'''

PYI_TEXT = """
def passthrough_negotiated() -> bool: ...
def backing_open(fd: int) -> int: ...
def backing_close(backing_id: int) -> None: ...
"""


PXD = "Include/fuse_common.pxd"
PYX = "src/pyfuse3/__init__.pyx"
PYI = "src/pyfuse3/__init__.pyi"
I4, I6, I8 = " " * 4, " " * 6, " " * 8
EDITS = [
    # C declarations of fields libfuse 3.17 has
    (PXD, "after", f"{I8}uint64_t lock_owner\n", f"{I8}int backing_id\n"),
    (PXD, "after", f"{I8}unsigned time_gran\n", f"{I8}unsigned max_backing_stack_depth\n"),
    (PXD, "after", f"{I6}FUSE_CAP_HANDLE_KILLPRIV\n", f"{I6}FUSE_CAP_PASSTHROUGH\n"),
    # FileInfo.backing_id, copied into the open reply
    (PYX, "after", f"{I4}cdef public bint nonseekable\n", f"{I4}cdef public int backing_id\n"),
    (PYX, "replace", "nonseekable=0):", "nonseekable=0, backing_id=0):"),
    (PYX, "after", f"{I8}self.nonseekable = nonseekable\n", f"{I8}self.backing_id = backing_id\n"),
    (PYX, "after", f"{I8}out.fh = self.fh\n", f"{I8}out.backing_id = self.backing_id\n"),
    # INIT asks for passthrough
    ("src/pyfuse3/handlers.pxi", "before", f"{I4}# Blocking rather than async", INIT_TEXT),
    # type stubs
    (PYI, "after", f"{I4}nonseekable: bool\n", f"{I4}backing_id: int\n"),
    (PYI, "after", f"{I8}nonseekable: bool = ...,\n", f"{I8}backing_id: int = ...,\n"),
]


# -- the build ----------------------------------------------------------------------------------
class Build:
    def __init__(self, venv: Path, jobs: int, force: bool) -> None:
        self.venv = venv
        here = venv == Path(sys.prefix).absolute()
        self.python = Path(sys.executable) if here else venv / "bin" / "python"
        # A system Python's site-packages (PEP 668) takes pip's consent; a venv needs none.
        self.pip_flags = (
            ["--break-system-packages"] if here and sys.prefix == sys.base_prefix else []
        )
        self.jobs = jobs
        self.force = force
        self.prefix = venv / "opt" / f"libfuse-{LIBFUSE_VERSION}"
        self.work = venv / "opt" / "build-passthrough"
        self.downloads = self.work / "downloads"
        self.tools = self.work / "tools"

    def check(self) -> None:
        if not self.python.exists():
            raise SystemExit(f"build-passthrough: {self.python} not found")
        missing = [t for t in ("cc", "pkg-config") if shutil.which(t) is None]
        if missing:
            raise SystemExit(
                f"build-passthrough: needs {' and '.join(missing)} "
                "(Debian: apt-get install gcc pkg-config)"
            )

    def tool_venv(self) -> None:
        stamp = self.tools / ".tools"
        if stamp.exists() and stamp.read_text() == "\n".join(TOOLS):
            return
        shutil.rmtree(self.tools, ignore_errors=True)
        log("build tools: " + " ".join(TOOLS))
        # From the target's interpreter, so the wheel is built for its Python.
        run([self.python, "-m", "venv", self.tools])
        run([self.tools / "bin/python", "-m", "pip", "install", "-q", *TOOLS])
        stamp.write_text("\n".join(TOOLS))

    def fetch(self) -> tuple[Path, Path]:
        self.downloads.mkdir(parents=True, exist_ok=True)
        libfuse = self.downloads / LIBFUSE_URL.rsplit("/", 1)[1]
        if not verified(libfuse, LIBFUSE_SHA256):
            log(f"downloading {LIBFUSE_URL}")
            part = libfuse.with_suffix(".part")
            with urllib.request.urlopen(LIBFUSE_URL, timeout=120) as r, open(part, "wb") as f:
                shutil.copyfileobj(r, f)
            part.rename(libfuse)
            verified(libfuse, LIBFUSE_SHA256)
        sdist = self.downloads / PYFUSE3_SDIST
        if not verified(sdist, PYFUSE3_SHA256):
            log(f"downloading pyfuse3 {PYFUSE3_VERSION} sdist from PyPI")
            run(
                [self.tools / "bin/python", "-m", "pip", "download", "-q", "--no-deps",
                 "--no-binary", ":all:", f"pyfuse3=={PYFUSE3_VERSION}", "-d", self.downloads]
            )  # fmt: skip
            if not verified(sdist, PYFUSE3_SHA256):
                raise SystemExit(f"build-passthrough: pip did not download {PYFUSE3_SDIST}")
        return libfuse, sdist

    def libfuse_built(self) -> bool:
        stamp = self.prefix / ".modelfs-built"
        return stamp.exists() and stamp.read_text().strip() == LIBFUSE_SHA256

    def build_libfuse(self, tarball: Path) -> None:
        src = unpack(tarball, self.work / "src-libfuse")
        build = self.work / "build-libfuse"
        shutil.rmtree(build, ignore_errors=True)
        shutil.rmtree(self.prefix, ignore_errors=True)
        env = {**os.environ, "PATH": f"{self.tools / 'bin'}:{os.environ['PATH']}"}
        log(f"libfuse {LIBFUSE_VERSION} -> {self.prefix}")
        quiet = {"env": env, "stdout": subprocess.DEVNULL}
        run(
            ["meson", "setup", build, src, f"--prefix={self.prefix}", "--libdir=lib",
             "-Dutils=false", "-Dexamples=false", "-Dtests=false", "-Duseroot=false",
             "-Dinitscriptdir="], **quiet,
        )  # fmt: skip
        run(["ninja", "-C", build, f"-j{self.jobs}"], **quiet)
        run(["meson", "install", "-C", build], **quiet)
        (self.prefix / ".modelfs-built").write_text(LIBFUSE_SHA256 + "\n")

    def pyfuse3_installed(self) -> bool:
        """The venv's pyfuse3 is ours and loads the private libfuse."""
        probe = (
            "import pyfuse3, sys\n"
            "pyfuse3.backing_open\n"
            "libs = {l.split()[-1] for l in open('/proc/self/maps') if 'libfuse3' in l}\n"
            "print(pyfuse3.__version__, *sorted(libs))\n"
        )
        done = subprocess.run(
            [self.python, "-c", probe], capture_output=True, text=True, check=False
        )
        want = f"{PYFUSE3_BUILD} {self.prefix.resolve()}/lib/libfuse3.so.{LIBFUSE_VERSION}"
        return done.returncode == 0 and done.stdout.strip() == want

    def build_pyfuse3(self, sdist: Path) -> None:
        src = unpack(sdist, self.work / "src-pyfuse3")
        patch_pyfuse3(src)
        (src / "src/pyfuse3/__init__.c").unlink(missing_ok=True)  # Cython regenerates it
        wheels = self.work / "wheels"
        shutil.rmtree(wheels, ignore_errors=True)
        lib = self.prefix / "lib"
        env = {
            **os.environ,
            "PKG_CONFIG_PATH": f"{lib}/pkgconfig",
            "LDFLAGS": f"{os.environ.get('LDFLAGS', '')} -Wl,-rpath,{lib}".strip(),
            "SETUPTOOLS_SCM_PRETEND_VERSION": PYFUSE3_BUILD,
        }
        found = subprocess.run(
            ["pkg-config", "--modversion", "fuse3"], env=env, capture_output=True, text=True
        ).stdout.strip()
        if found != LIBFUSE_VERSION:
            raise SystemExit(f"build-passthrough: pkg-config finds fuse3 {found!r}, not ours")
        log(f"pyfuse3 {PYFUSE3_BUILD} (Cython, then the C compiler: ~30 s)")
        run(
            [self.tools / "bin/python", "-m", "pip", "wheel", "-q", "--no-deps",
             "--no-build-isolation", "-w", wheels, src], env=env,
        )  # fmt: skip
        (wheel,) = wheels.glob("pyfuse3-*.whl")
        run([self.python, "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall",
             *self.pip_flags, wheel])  # fmt: skip

    def main(self) -> None:
        self.check()
        t0 = time.monotonic()
        if not self.force and self.libfuse_built() and self.pyfuse3_installed():
            log(f"already in place: pyfuse3 {PYFUSE3_BUILD} on {self.prefix}")
            return
        self.tool_venv()
        libfuse, sdist = self.fetch()
        if self.force or not self.libfuse_built():
            self.build_libfuse(libfuse)
        self.build_pyfuse3(sdist)
        if not self.pyfuse3_installed():
            raise SystemExit("build-passthrough: the installed pyfuse3 does not load our libfuse")
        log(f"done in {time.monotonic() - t0:.0f} s: pyfuse3 {PYFUSE3_BUILD} in {self.venv}")


def main(
    argv: list[str], *, prog: str = "modelfs build-passthrough", venv: Path | None = None
) -> int:
    p = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").split("\n")[0])
    p.add_argument(
        "--venv",
        type=Path,
        default=venv or Path(sys.prefix),
        help="the Python environment to install into (default: %(default)s)",
    )
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs (default 2)")
    p.add_argument("--force", action="store_true", help="rebuild libfuse and pyfuse3")
    args = p.parse_args(argv)
    # Not resolved: a symlinked .venv stays the venv it names.
    try:
        Build(args.venv.absolute(), args.jobs, args.force).main()
    except subprocess.CalledProcessError as exc:
        cmd = " ".join(str(a) for a in exc.cmd[:4])
        log(f"failed: {cmd} … exited with {exc.returncode} (its output is above)")
        return 1
    except OSError as exc:  # no network (URLError), a full disk, a missing compiler
        log(f"failed: {getattr(exc, 'reason', None) or exc.strerror or exc}")
        return 1
    return 0
