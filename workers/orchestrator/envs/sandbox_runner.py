"""Test runner inside the sandbox: ``python -I -S runner.py test_a.py ...`` (stdlib only).

Reads a nonce from the first line of stdin (then closes stdin) and prints one line per test
function, flushed as it goes so a run killed half-way still reports what finished::

    <nonce> PASS test_calc.py::test_add_0
    <nonce> FAIL test_calc.py::test_add_1 AssertionError: ...

The env counts only lines carrying its nonce and treats unreported tests as failed, so
stray output of the code under test cannot fake a pass by printing ``PASS``. (Code that
deliberately digs the nonce out of this process's memory can; the sandbox protects the
host, the hidden nonce only stops accidents and naive hacks.)

With ``SANDBOX_AUDIT=1`` (the weak ``rlimits`` mode, where no namespaces exist)
an audit hook refuses sockets, ctypes, and opening files outside cwd, /tmp and the
interpreter's own directories: best effort, as documented in sandbox_exec.py.
"""
import importlib.util
import os
import sys
import traceback


def install_audit_hook() -> None:
    allowed = tuple(os.path.realpath(p) + os.sep for p in
                    (os.getcwd(), sys.prefix, sys.base_prefix, sys.exec_prefix, "/dev/null", "/usr/lib"))

    def hook(event, args):
        if event in ("socket.__new__", "socket.connect", "socket.bind", "ctypes.dlopen", "ctypes.cdata"):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open" and isinstance(args[0], (str, bytes)):
            path = os.path.realpath(os.fsdecode(args[0])) + os.sep
            if not path.startswith(allowed):
                raise PermissionError(f"sandbox: open({args[0]!r}) outside the project is not allowed")

    sys.addaudithook(hook)


def run_file(path: str, nonce: str) -> None:
    name = os.path.splitext(os.path.basename(path))[0]
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - a broken project is a result, not a crash
        print(f"{nonce} ERROR {path}::<import> {type(e).__name__}: {str(e)[:200]}", flush=True)
        return
    tests = [(n, f) for n, f in vars(module).items() if n.startswith("test_") and callable(f)]
    for test_name, fn in tests:
        try:
            fn()
            status, msg = "PASS", ""
        except AssertionError as e:
            status, msg = "FAIL", f"AssertionError: {str(e)[:200]}"
        except BaseException as e:  # noqa: BLE001
            status, msg = "ERROR", f"{type(e).__name__}: {str(e)[:200]}"
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                msg += " (raised by the code under test)"
        line = f"{nonce} {status} {path}::{test_name}"
        print(f"{line} {msg}".rstrip() if msg else line, flush=True)
        if status == "ERROR" and os.environ.get("SANDBOX_TRACE"):
            traceback.print_exc()


def main() -> None:
    nonce = sys.stdin.readline().strip()
    sys.stdin.close()
    os.close(0)
    if os.environ.get("SANDBOX_AUDIT") == "1":
        install_audit_hook()
    sys.path.insert(0, os.getcwd())
    for path in sys.argv[1:]:
        run_file(path, nonce)
    sys.stdout.flush()
    os._exit(0)  # no atexit hooks of the code under test run after the report


if __name__ == "__main__":
    main()
