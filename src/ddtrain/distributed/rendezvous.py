"""Meet the other ranks before the process group forms, with one deadline on every rank and the cause named.

torch's ``env://`` rendezvous keeps rank 0 inside the store's constructor until every rank
connects ("1/2 clients joined" after the whole timeout, naming no rank), and a rank whose
MASTER_PORT is held by another program connects to that program and waits for an answer that
never comes, past any timeout. Here rank 0 hosts the store without waiting, a rank connects
only once something listens there (and gives up on a listener that does not answer as a
store), every rank checks in under its own key, and at the deadline each names what it waited
for: the ranks that never came, the port in use, the program holding it.
"""
from __future__ import annotations

import datetime
import os
import socket
import threading
import time
from urllib.parse import parse_qs, urlencode, urlparse

from ddtrain.distributed.job import restart_attempt, set_restart_attempt
from ddtrain.errors import DDTrainError

# A store answers a new connection within milliseconds; a listener silent this long is another program.
FOREIGN_S = 10.0
POLL_S = 0.1


def _deadline_words(timeout_s: float) -> str:
    return f"the {timeout_s:g} s deadline (--timeout, DDTRAIN_TIMEOUT_S)"


def stale_hint(env) -> str:
    """Words about RANK/WORLD_SIZE that no torchrun set (left in the shell by an earlier job?), or ''."""
    if env.launcher == "torchrun" and not os.environ.get("TORCHELASTIC_RUN_ID"):
        return (f"; RANK={os.environ.get('RANK')} and WORLD_SIZE={os.environ.get('WORLD_SIZE')} come from the "
                f"environment, not from torchrun (no TORCHELASTIC_RUN_ID): if an earlier job left them in the "
                f"shell, unset them (or use --nproc N)")
    return ""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


SCHEME = "ddtrain"


def init_method(timeout_s: float) -> str:
    """The ``init_method`` for ``torch.distributed.init_process_group`` that meets through ``connect``."""
    from torch.distributed import register_rendezvous_handler
    from torch.distributed.rendezvous import _rendezvous_handlers
    if SCHEME not in _rendezvous_handlers:
        register_rendezvous_handler(SCHEME, _handler)
    return f"{SCHEME}://?{urlencode({'deadline': repr(float(timeout_s))})}"


def _handler(url: str, **_kwargs):
    """torch's rendezvous protocol: yield (store, rank, world size) once."""
    from ddtrain.distributed.env import detect_env
    timeout_s = float(parse_qs(urlparse(url).query)["deadline"][0])
    env = detect_env()
    yield connect(env, timeout_s), env.rank, env.world_size
    raise DDTrainError("the process group cannot re-join through ddtrain's rendezvous; start the job again")


_rounds = 0   # process groups this process joined through ``connect`` (every rank joins as often, in order)


def connect(env, timeout_s: float):
    """The job's store (hosted by rank 0, or by torchrun's agent), every rank checked in, within ``timeout_s``."""
    from torch.distributed import PrefixStore, TCPStore
    start = time.monotonic()
    deadline = start + timeout_s
    host, port = env.master_addr, env.master_port
    where = f"{host}:{port} (MASTER_ADDR:MASTER_PORT)"
    if not 0 < port < 65536:
        raise DDTrainError(f"MASTER_PORT={port} is not a port number (1-65535)")
    add_attempt_base()
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    limit = datetime.timedelta(seconds=max(timeout_s, 1e-3))
    if env.rank == 0 and not agent_store:
        try:
            store = TCPStore(host, port, world_size=env.world_size, is_master=True, timeout=limit,
                             wait_for_workers=False, multi_tenant=True)
        except Exception as exc:  # DistNetworkError: bind or listen failed
            if "EADDRINUSE" in str(exc) or "address already in use" in str(exc).lower():
                raise DDTrainError(f"rank 0 cannot host the rendezvous on {where}: the port is in use by "
                                   f"another program; set MASTER_PORT to a free port") from None
            raise DDTrainError(f"rank 0 cannot host the rendezvous on {where}: {_first_line(exc)}") from None
    else:
        store = _join(env, host, port, where, limit, timeout_s, deadline)
    if agent_store:
        # torch < 2.5 reuses the agent's store across restarts: the dead attempt's keys must not be seen.
        store = PrefixStore(f"/worker/attempt_{restart_attempt()}", store)
    global _rounds
    if _rounds:   # init() again after shutdown() in this process: the store (the agent's, or rank 0's
        # multi-tenant server) still holds the earlier rounds' keys, which a new group would read as its own
        store = PrefixStore(f"ddtrain/round_{_rounds}", store)
    _rounds += 1
    _check_in(store, env, timeout_s, deadline, where)
    return store


def _join(env, host, port, where, limit, timeout_s, deadline):
    """A client of the store at host:port, or DDTrainError naming why not by the deadline."""
    from torch.distributed import TCPStore
    host_name = "torchrun's agent" if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" else "rank 0"
    last_error, heard = None, False
    while True:
        if _listening(host, port):
            heard = True
            box: dict = {}

            def make():
                try:
                    box["store"] = TCPStore(host, port, world_size=env.world_size, is_master=False,
                                            timeout=limit, wait_for_workers=False)
                except Exception as exc:  # refused or reset: rank 0 not ready after all
                    box["error"] = exc

            # The constructor cannot be interrupted, and against a program that is no store it waits
            # forever: it runs in a daemon thread and is abandoned (the process then exits).
            thread = threading.Thread(target=make, daemon=True, name="ddtrain-rendezvous")
            asked = time.monotonic()
            thread.start()
            thread.join(max(0.0, min(FOREIGN_S, deadline - time.monotonic())))
            if "store" in box:
                return box["store"]
            if thread.is_alive() and time.monotonic() - asked < FOREIGN_S:
                last_error = None
                break
            if thread.is_alive():
                raise DDTrainError(f"the program listening on {where} is not {host_name}'s "
                                   f"rendezvous store (no answer in {time.monotonic() - asked:.0f} s): MASTER_PORT "
                                   f"is held by another program; set MASTER_PORT to a free port")
            last_error = box.get("error")
        if time.monotonic() >= deadline:
            break
        time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    if heard:
        seen = f": {_first_line(last_error)}" if last_error else ""
        what = f"{host_name}'s store there did not let this rank in{seen}"
    else:
        what = f"{host_name} never opened it (nothing listens there)"
    raise DDTrainError(f"no rendezvous on {where} within "
                       f"{_deadline_words(timeout_s)}: {what}{stale_hint(env)}")


# Attempts before this torchrun started: set by an elastic launcher that starts torchrun anew at each
# world size (dist.launch.run_elastic), whose torchrun counts from 0 again.
ATTEMPT_BASE_ENV = "DDTRAIN_ATTEMPT_BASE"


# Every restart of the workers by this node's agent, a node joining included (dist.launch.count_reforms).
REFORMS_ENV = "DDTRAIN_REFORMS"


def _count(name: str) -> int:
    value = os.environ.pop(name, "").strip()
    return int(value) if value.isdecimal() else 0


def add_attempt_base() -> None:
    """Count every earlier attempt of this job into the restart attempt (``job.restart_attempt``) (once per process).

    torchrun counts only the restarts after a failure: when a node joins an elastic job its agents
    restart the workers with the count unchanged (0 if nothing failed yet), and those workers
    would start from step 0 instead of the last checkpoint. ddtrain's agents count every restart
    (DDTRAIN_REFORMS); an elastic launcher that starts torchrun anew per size adds its earlier
    attempts (DDTRAIN_ATTEMPT_BASE). The loop resumes, and faults stay quiet, after the first.
    """
    base, reforms = _count(ATTEMPT_BASE_ENV), _count(REFORMS_ENV)
    if base or reforms:
        set_restart_attempt(max(restart_attempt(), reforms) + base)


def _check_in(store, env, timeout_s, deadline, where):
    """Every rank sets its key, then waits for all of them; at the deadline the missing ranks are named.

    The keys carry no attempt number: the store is this attempt's own (a fresh one per restart, or
    the agent's behind a per-attempt prefix). Each rank checks in with its restart attempt,
    and every rank then takes the largest (``_agree_attempt``).
    """
    keys = [f"ddtrain/rendezvous/{r}" for r in range(env.world_size)]
    try:
        store.set(keys[env.rank], str(restart_attempt()))
        while not store.check(keys):
            if time.monotonic() >= deadline:
                missing = [r for r, key in enumerate(keys) if not store.check([key])]
                if not missing:
                    return
                names = ", ".join(map(str, missing))
                raise DDTrainError(f"rank{'s' if len(missing) > 1 else ''} {names} of {env.world_size} "
                                   f"never joined the rendezvous on {where} within "
                                   f"{_deadline_words(timeout_s)}{stale_hint(env)}")
            time.sleep(POLL_S)
        _agree_attempt([store.get(key).decode() for key in keys])
    except DDTrainError:
        raise
    except Exception as exc:  # the store's host went away while we waited
        raise DDTrainError(f"lost the rendezvous on {where} while the ranks gathered "
                           f"(its host, rank 0 or torchrun's agent, has stopped?): {_first_line(exc)}") from None


def _agree_attempt(counts: list[str]) -> None:
    """Every rank of a restarted multi-node job takes the same attempt number: the largest.

    torchrun counts restarts per node: the agent whose worker failed counts one, while an agent
    that restarts its healthy workers because another node re-joined counts none. Left as they
    are, the ranks of one attempt would wait on keys of different attempts (here, in the doctor,
    the stall and watchdog keys) and a restarted node would fire its DDTRAIN_FAULT again.
    """
    attempt = max((int(c) for c in counts if c.strip().isdecimal()), default=0)
    if attempt > restart_attempt():
        set_restart_attempt(attempt)
