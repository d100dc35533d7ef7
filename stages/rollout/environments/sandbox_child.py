"""The sandbox's own process: `python -I sandbox_child.py ROOT MODE LIMITS...`, started by
`sandbox.run_python`. It contains itself, then runs ROOT/main.py as __main__ in ROOT/work.

MODE 'strict' (what `sandbox.py` documents): new mount and network namespaces (and a user
namespace unless root); a fresh root filesystem holding only what Python needs, read-only, plus
the scratch folder; then every privilege given up. Any step failing stops it before the code
runs. MODE 'rlimits_only': the limits and an audit hook refusing Python's sockets, nothing more.

Standard library only, imported before the filesystem is swapped: the new root holds Python's
own prefixes, not the rest of this package. It writes which mode held (or why strict failed) to
ROOT/isolation, through a file opened before the swap.
"""

import ctypes
import linecache
import os
import platform
import resource
import sys
import traceback

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = (
    1, 2, 4, 8, 32, 4096, 16384, 1 << 18)
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS = 38
#: statvfs flags a remount inside a user namespace must keep (the kernel locks them): ST_* -> MS_*
LOCKED_FLAGS = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC,
                os.ST_NOATIME: 1024, os.ST_NODIRATIME: 2048, os.ST_RELATIME: 1 << 21}
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}  # glibc has no wrapper for the syscall
#: What the code sees besides Python's prefixes and its scratch folder, all read-only.
SYSTEM_PATHS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
NOBODY = 65534

libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [None if s is None else s.encode() for s in (source, target, fstype, data)]
    _check(libc.mount(*args[:3], ctypes.c_ulong(flags), args[3]), f"mount {source or ''} on {target}")


def _enter_namespaces(scratch: str) -> tuple[int, int]:
    """Enter new mount and network namespaces; return the uid and gid the code will run as.

    Root (with CAP_SYS_ADMIN) needs no user namespace: the code will run as nobody, which owns
    nothing outside the scratch folder (handed to it now). Anyone else enters a user namespace too
    (where it may mount), mapping only its own uid and gid, and keeps them."""
    if os.geteuid() == 0 and libc.unshare(CLONE_NEWNS | CLONE_NEWNET) == 0:
        os.chown(scratch, NOBODY, NOBODY)
        return NOBODY, NOBODY
    uid, gid = os.geteuid(), os.getegid()
    _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET), "unshare(user, mount, network namespaces)")
    _write("/proc/self/setgroups", "deny")  # required before an unprivileged gid_map
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    return uid, gid


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _visible() -> list[str]:
    """The host paths the code sees (read-only), each once: those under another are covered."""
    real_exe_dir = os.path.dirname(os.path.realpath(sys.executable))
    paths = [p for p in (*SYSTEM_PATHS, sys.base_prefix, sys.prefix, real_exe_dir, *DEVICES) if os.path.lexists(p)]
    out: list[str] = []
    for path in sorted(set(map(os.path.normpath, paths))):
        if not any(path.startswith(seen.rstrip("/") + "/") for seen in out):
            out.append(path)
    return out


def _bind(source: str, new_root: str, writable: bool) -> None:
    """`source` at the same path under `new_root`: a symlink copied, a folder or file bound."""
    target = new_root + source
    os.makedirs(os.path.dirname(target), exist_ok=True)
    if os.path.islink(source):  # /bin -> usr/bin on merged-/usr systems
        os.symlink(os.readlink(source), target)
        return
    if os.path.isdir(source):
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "w").close()
    _mount(source, target, None, MS_BIND)
    if not writable:
        _read_only(target)


def _read_only(target: str) -> None:
    kept = sum(ms for st, ms in LOCKED_FLAGS.items() if os.statvfs(target).f_flag & st)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def _enter_new_root(root: str, scratch: str) -> None:
    """Swap the filesystem for a tmpfs holding `_visible()` read-only and `scratch` writable, the
    old root detached (nothing left to climb back to), the new one read-only too."""
    new_root = os.path.join(root, "fs")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here reaches the host's mounts
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for path in _visible():
        _bind(path, new_root, writable=False)
    _bind(scratch, new_root, writable=True)
    number = PIVOT_ROOT.get(platform.machine())
    if number is None:
        raise OSError(f"pivot_root: no syscall number known for {platform.machine()}")
    os.chdir(new_root)
    _check(libc.syscall(number, b".", b"."), "pivot_root")  # the old root now lies under the new
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    _read_only("/")
    os.chdir(scratch)


def _drop_privileges(uid: int, gid: int) -> None:
    """No way back: the code runs as `uid` with no capabilities in any namespace, and exec cannot
    give it any (no_new_privs: setuid binaries and file capabilities do nothing)."""
    if os.geteuid() == 0 and uid == NOBODY:  # root's supplementary groups go too
        os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    _check(libc.capset(header, (ctypes.c_uint32 * 6)()), "capset (drop every capability)")


def _strict(root: str, scratch: str) -> None:
    uid, gid = _enter_namespaces(scratch)
    _enter_new_root(root, scratch)
    _drop_privileges(uid, gid)


def _audit_hook_only() -> None:
    def no_network(event: str, args: tuple) -> None:
        if event in ("socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo"):
            raise PermissionError("network access is disabled in this sandbox")

    sys.addaudithook(no_network)  # Python code cannot remove it (ctypes can go around it)


def main() -> None:
    root, mode, *limits = sys.argv[1:]
    scratch = os.path.join(root, "work")
    source = open(os.path.join(root, "main.py")).read()
    with open(os.path.join(root, "isolation"), "w") as said:
        if mode == "strict":
            try:
                _strict(root, scratch)
            except Exception as e:  # nothing runs outside the sandbox it was promised
                said.write(f"failed: {e}")
                sys.exit(125)
        else:
            _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
            _audit_hook_only()
        said.write(mode)
    for which, value in zip((resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_FSIZE,
                             resource.RLIMIT_NOFILE, resource.RLIMIT_NPROC), map(int, limits), strict=True):
        resource.setrlimit(which, (value, value))
    _run(source)


def _run(source: str) -> None:
    """`source` as __main__ from 'main.py' (which tracebacks quote), this file's frames cut."""
    linecache.cache["main.py"] = (len(source), None, source.splitlines(True), "main.py")
    sys.argv = ["main.py"]
    try:
        exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
    except SystemExit:
        raise
    except BaseException as e:
        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
        sys.exit(1)


if __name__ == "__main__":
    main()
