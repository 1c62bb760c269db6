"""The embedded server's admission and connection options are checked at plan time (issue 22),
and the orchestrator's client reads Retry-After the way the server writes it."""
from __future__ import annotations

import pytest

from tests.conftest import plan, plan_error
from workers.common.inference_client import BUSY_BACKOFF_MAX_S, _seconds


@pytest.mark.parametrize("override, key", [
    ("inference.max_queued_requests=0", "inference.max_queued_requests"),
    ("inference.max_queued_requests=-5", "inference.max_queued_requests"),
    ("inference.idle_timeout_s=0", "inference.idle_timeout_s"),
    ("inference.idle_timeout_s=-1", "inference.idle_timeout_s"),
    ("inference.idle_timeout_s=inf", "inference.idle_timeout_s"),
])
def test_bad_limits_are_refused_naming_the_key(override, key):
    assert key in plan_error(["inference=embedded", override])


def test_defaults_and_skip_nonfinite_plan():
    p = plan(["inference=embedded", "weights.skip_nonfinite=true"])
    assert p is not None


@pytest.mark.parametrize("header, seconds", [("1", 1.0), ("0.25", 0.25), ("", 0.0), ("soon", 0.0),
                                             ("Wed, 21 Oct 2015 07:28:00 GMT", 0.0), ("3600", BUSY_BACKOFF_MAX_S)])
def test_retry_after_is_read_and_capped(header, seconds):
    assert _seconds(header) == seconds
