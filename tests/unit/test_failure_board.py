"""The failure board's choice of the first real failure (`fullshard.launch.failure_board`), without
processes: a real exception beats a death by signal, which beats a lost connection."""

from __future__ import annotations

from fullshard.launch.failure_board import Posted, brief, first_posted, looks_like_lost_peer

GLOO = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
        "Read error [127.0.0.1]:1200: Connection reset by peer. This is typically caused by a "
        "remote worker hanging or bugs in the application.")


def _p(rank: int, t: float, how: str, cause: str, node: int = 0) -> Posted:
    return Posted(rank, 0, "h", 100 + rank, t, how, cause, node)


def test_brief_and_lost_peer() -> None:
    assert brief(GLOO) == "RuntimeError: Read error [127.0.0.1]:1200: Connection reset by peer"
    assert looks_like_lost_peer(GLOO) and looks_like_lost_peer("Connection closed by peer")
    assert not looks_like_lost_peer("RuntimeError: injected failure on rank 1")
    assert brief("ValueError: x") == "ValueError: x"


def test_first_posted_order() -> None:
    lost0 = _p(0, 1.0, "raised", brief(GLOO))
    killed1 = _p(1, 2.0, "signal", "SIGKILL", node=1)  # its launcher posts later, whole seconds
    stopped2 = _p(2, 1.5, "stopped", "PeerFailed: ...")
    assert lost0.consequence and stopped2.consequence and not killed1.consequence
    assert first_posted([lost0, killed1, stopped2]) == killed1
    real = _p(3, 3.0, "raised", "RuntimeError: injected")
    assert first_posted([lost0, killed1, real]) == real  # an exception has a cause to name
    assert first_posted([lost0, stopped2]) == lost0  # only consequences: the earliest
    assert first_posted([lost0], besides=0) is None
    assert first_posted([]) is None
    said = killed1.describe()
    assert said == "rank 1 (local rank 0, host h, pid 101) was killed by signal SIGKILL"
    assert _p(4, 0, "exit", "code 3").describe().endswith("exited with code 3")
