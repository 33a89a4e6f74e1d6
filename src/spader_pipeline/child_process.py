"""Run a memory-heavy call (a training run, one model's evaluation) in a fresh child process.

Why: a long Kedro run (``make compare``: a warm start, then 6 training runs and 7 evaluations in
one process) keeps what each stage allocated. Freed tensors go back to the allocator, not always to
the operating system (small blocks fragment the heap; caches and imports stay), so the process's
resident memory grows from one stage to the next (docs/reliability.md). A child process returns all
of it when it ends, whatever kept it.

How: ``multiprocessing``'s *forkserver* start method on Linux (*spawn* elsewhere). A server
process, started with the first child (or earlier: :func:`start_server`) and kept for this process's
life, imports the modules every
heavy stage needs (:data:`PRELOADED`: torch, transformers, the trainer, the evaluator) once; each
child is a fork of that server: a process with those imports and nothing else (no copy of this
process's heap or threads), so it starts in a fraction of a second instead of the ~5-10 s a fresh
interpreter spends importing. The function and its arguments are pickled to it, the result or the
exception pickled back. The child runs in this process's current directory, ``sys.path`` and
environment (``os.environ`` as it is at the call; a variable a library reads when it is imported
counts as it was when the server started).

The child:

* ends (SIGTERM) when this process ends, however it ends: it holds the reading end of a pipe whose
  only writer is this process, and a thread of its own waits for that pipe's end of file. The same
  under either start method; Linux's ``PR_SET_PDEATHSIG`` would not do, since a forked child's
  parent is the fork server, which outlives this process while a child holds the server's lifeline.
  It is terminated if this process is interrupted;
* logs through the parent: its records go back over a queue to the parent's loggers (Kedro's
  handlers, a test's ``caplog``), filtered by the parent's logger levels; it runs with the parent's torch
  thread count, or the count the caller gives (children run side by side share the cores);
* re-raises in the parent as the child's own exception, its traceback attached as a note; a child
  that ends without a result (killed: ``-9`` is SIGKILL, often the out-of-memory killer) raises
  :class:`ChildProcessDied`.

The price is pickling the arguments, and once per process the server's imports: worth it for calls
of seconds. MLflow's active run is not inherited: a function that logs takes the run's id
(:func:`spader_pipeline.tracking.buffer.run_writer`).
"""

from __future__ import annotations

import functools
import logging
import logging.handlers
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

from spader_pipeline.host_memory import bound_heap

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Imported once by the fork server, so that no child imports them again: the stages' entry points
#: (light modules, which the caller imports too) and what they run (the trainer, the warm start,
#: validation, the in-process generator; torch and transformers), which the caller need not import.
PRELOADED = ("torch", "transformers", "spader_pipeline.native.trainer", "spader_pipeline.native.warm_start",
             "spader_pipeline.native.validation", "spader_pipeline.agent.hf_backend",
             "spader_pipeline.native.stages", "spader_pipeline.evaluation.suite")


def runs_child_processes(fn: Callable[..., T]) -> Callable[..., T]:
    """Mark ``fn``, a Kedro node's function, as one that runs its heavy work in child processes: a
    run containing such a node starts the fork server as the run starts (:func:`start_server`,
    ``spader_pipeline.hooks.ForkServerHooks``). Returns ``fn`` itself."""
    fn.runs_child_processes = True  # type: ignore[attr-defined]
    return fn


def start_server() -> bool:
    """Start the fork server now, if it is not running (Linux; elsewhere children are spawned: False).

    Its imports (:data:`PRELOADED`, seconds of one core) then run beside this process's own work (a
    Kedro run's loading and its first, in-process nodes) instead of before the first child starts.
    Returns at once, without waiting for them."""
    context = _context()
    if context.get_start_method() != "forkserver":
        return False
    from multiprocessing import forkserver

    forkserver.ensure_running()
    return True


class ChildProcessDied(RuntimeError):
    """The child ended without sending a result or an exception (killed, or it crashed)."""


def in_child_process(fn: Callable[..., T], *, enabled: bool = True, name: str | None = None,
                     threads: int | None = None) -> Callable[..., T]:
    """``fn`` wrapped so that a call runs it in a fresh child process (or in this one when not
    ``enabled``). ``fn`` must be importable (a module-level function) and its arguments and
    result picklable; ``name`` labels the child in logs and errors (default: ``fn``'s name);
    ``threads``: the child's torch thread count (default: this process's), for children run side by side."""
    if not enabled:
        return fn
    label = name or fn.__name__

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> T:
        return _run(label, fn, args, kwargs, threads)

    return call


class _ToParentLoggers(logging.Handler):
    """Hands a child's log record to the parent's logger of the same name."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(record.name).handle(record)


def _context() -> multiprocessing.context.BaseContext:
    # Linux only: on macOS a fork of a process that loaded torch's system frameworks may crash, which
    # is why Python spawns there by default
    if not sys.platform.startswith("linux") or "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOADED))  # read when the server starts (the first child)
    return context


def _run(label: str, fn: Callable[..., T], args: tuple, kwargs: dict, threads: int | None = None) -> T:
    context = _context()
    receive, send = context.Pipe(duplex=False)
    records = context.Queue()
    listener = logging.handlers.QueueListener(records, _ToParentLoggers())
    settings = {"log_levels": _log_levels(), "torch_threads": threads or _torch_threads(), "log_queue": records,
                "environ": dict(os.environ)}
    lifeline, keep_alive = context.Pipe(duplex=False)  # end of file in the child once this process ends
    child = context.Process(target=_child_main, args=(send, fn, args, kwargs, settings, lifeline), name=label)
    listener.start()
    child.start()
    send.close()  # only the child writes; the parent's recv then sees EOF if the child dies
    lifeline.close()
    logger.info("%s: running in child process %d", label, child.pid)
    try:
        try:
            status, payload = receive.recv()
        except EOFError:
            child.join()
            raise ChildProcessDied(
                f"{label}: the child process {child.pid} ended without a result (exit code {child.exitcode}; "
                "a negative code is the signal that ended it: -9 is SIGKILL, often the out-of-memory killer)"
            ) from None
        child.join()
    except BaseException:
        if child.is_alive():  # interrupted (Ctrl-C) or failed while the child runs: stop it
            child.terminate()
            child.join(10)
            if child.is_alive():
                child.kill()
        raise
    finally:
        receive.close()
        keep_alive.close()
        listener.stop()  # after the child's last record
        records.close()
    if status == "error":
        raise payload
    return payload


def _log_levels() -> dict[str, int]:
    """The levels set on the parent's loggers (root as ``""``): the child filters as the parent does."""
    levels = {"": logging.getLogger().level}
    for name, item in logging.root.manager.loggerDict.items():
        if isinstance(item, logging.Logger) and item.level != logging.NOTSET:
            levels[name] = item.level
    return levels


def _torch_threads() -> int | None:
    torch = sys.modules.get("torch")
    return torch.get_num_threads() if torch is not None else None


def _child_main(send, fn: Callable[..., Any], args: tuple, kwargs: dict, settings: dict[str, Any],
                lifeline) -> None:
    _end_with_caller(lifeline)
    os.environ.clear()  # the caller's environment now, not the fork server's from its start
    os.environ.update(settings["environ"])
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.addHandler(logging.handlers.QueueHandler(settings["log_queue"]))
    for name, level in settings["log_levels"].items():
        logging.getLogger(name or None).setLevel(level)
    if settings.get("torch_threads"):
        import torch

        torch.set_num_threads(settings["torch_threads"])
    bound_heap()  # a heavy stage's heap returns what it frees (host_memory)
    try:
        message: tuple[str, Any] = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - every failure goes back to the parent
        message = ("error", _portable(exc))
    try:
        send.send(message)
    except Exception as exc:  # noqa: BLE001 - e.g. an unpicklable result
        send.send(("error", RuntimeError(f"{fn.__name__}: its result could not be sent back: {exc!r}")))
    finally:
        send.close()


def _portable(exc: BaseException) -> BaseException:
    """``exc`` with the child's traceback as a note, or a ``RuntimeError`` carrying its text when
    ``exc`` does not survive pickling."""
    import pickle

    text = "".join(traceback.format_exception(exc))
    try:
        copy = pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001
        return RuntimeError(f"in the child process:\n{text}")
    copy.add_note(f"in the child process:\n{text}")
    return copy


def _end_with_caller(lifeline) -> None:
    """SIGTERM to this process once ``lifeline`` (a pipe only the caller writes to) reaches end of file."""
    import signal
    import threading

    def wait_for_the_end() -> None:
        try:
            while True:
                lifeline.recv_bytes()
        except (EOFError, OSError):
            pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=wait_for_the_end, name="caller-lifeline", daemon=True).start()
