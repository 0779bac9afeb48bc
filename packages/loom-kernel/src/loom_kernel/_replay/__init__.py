"""The replay context: a flow's code run once from the top against its folded journal.
Each ctx operation's decision (claim, replay or decide, record) is made in one place;
the sync and async contexts are thin faces over it, and a drive reaches the store only
through the record its host gives it. It imports the core and the SPI.
"""

from loom_kernel._replay._async_context import AsyncContext
from loom_kernel._replay._context import Context
from loom_kernel._replay._driving import (
    Drive,
    FlowPass,
    awaitable_sleep,
    drive_here,
    drive_on_loop,
    on_loop,
    replay_check,
    run_flow,
)
from loom_kernel._replay._flows import NO_RETRY, Flow, RetryPolicy, check_flow_name, code_hash, flow
from loom_kernel._replay._host import RELEASE, Counters, DriveControl, Host, Unwind
from loom_kernel._replay._servant import FLOW_LOOP, LoopStoppedError, LoopThread, Outcome, Servant
from loom_kernel._replay._threads import CallThreads, call_threads, in_a_thread, let_go
from loom_kernel._replay._tracing import DriveSpan, Tracing
from loom_kernel._replay._waits import (
    RESERVED_RESUME_KEYS,
    TIMER_GATE,
    Message,
    consumed_positions,
    gate_payload,
    message_key,
    message_payload,
    timer_resume_key,
    validate_topic,
    wait_of,
)

__all__ = [
    "FLOW_LOOP",
    "NO_RETRY",
    "RELEASE",
    "RESERVED_RESUME_KEYS",
    "TIMER_GATE",
    "AsyncContext",
    "CallThreads",
    "Context",
    "Counters",
    "Drive",
    "DriveControl",
    "DriveSpan",
    "Flow",
    "FlowPass",
    "Host",
    "LoopStoppedError",
    "LoopThread",
    "Message",
    "Outcome",
    "RetryPolicy",
    "Servant",
    "Tracing",
    "Unwind",
    "awaitable_sleep",
    "call_threads",
    "check_flow_name",
    "code_hash",
    "consumed_positions",
    "drive_here",
    "drive_on_loop",
    "flow",
    "gate_payload",
    "in_a_thread",
    "let_go",
    "message_key",
    "message_payload",
    "on_loop",
    "replay_check",
    "run_flow",
    "timer_resume_key",
    "validate_topic",
    "wait_of",
]
