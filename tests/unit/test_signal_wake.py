"""The launcher's supervision loop wakes at once on a signal (:class:`SignalWake`): pyzmq runs the Python handler
on EINTR and then polls again for the rest of the timeout, so Ctrl-C reached the cards up to one poll timeout
(200 ms) late and, with short steps, one step more ran than the documented "finish the step in progress"
(fresh-clone review: the interrupt line after step 18's, steps 19 and 20 ran, step 20 saved). Checked by what the
poll returns (the wake descriptor), not by timing: without the wake it returns nothing after its timeout."""
from __future__ import annotations

import os
import signal
import threading

import zmq

from npu_train.runtime.coordinator import SignalWake


def test_a_signal_ends_the_supervision_poll_with_the_wake_event():
    seen = []
    old = signal.signal(signal.SIGUSR2, lambda signum, frame: seen.append(signum))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind("inproc://wake-test")
    prev = signal.set_wakeup_fd(-1)  # the harness's own (tests/conftest.py), if any
    signal.set_wakeup_fd(prev, warn_on_full_buffer=False)
    wake = SignalWake()
    try:
        assert wake.fd is not None
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake.fd, zmq.POLLIN)
        t = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR2))
        t.start()
        events = dict(poller.poll(20000))  # no message ever comes on sock
        t.join()
        assert seen == [signal.SIGUSR2]  # the handler ran
        assert wake.fd in events and sock not in events, events
        wake.drain()
        assert dict(poller.poll(0)) == {}  # drained: the next poll waits again
    finally:
        wake.close()
        signal.signal(signal.SIGUSR2, old)
        sock.close(0)
        ctx.term()
    assert signal.set_wakeup_fd(prev, warn_on_full_buffer=False) == prev  # the previous wakeup fd is back
