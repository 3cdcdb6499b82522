"""A bad RetryPolicy is refused at construction, naming the field and the value, in one line."""

from __future__ import annotations

import logging
import math
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from kvfsm.policy import RetryPolicy
from kvfsm.testing import FakeNixlAgent
from kvfsm.tiers import ObjectStoreTier

NAN, INF = math.nan, math.inf


@pytest.mark.parametrize(("field", "value", "message"), [
    ("max_attempts", "3", "RetryPolicy.max_attempts must be an int or None, got '3' (str)"),
    ("max_attempts", 2.0, "RetryPolicy.max_attempts must be an int or None, got 2.0"),
    ("max_attempts", INF, "RetryPolicy.max_attempts must be an int or None, got inf"),
    ("max_attempts", True, "RetryPolicy.max_attempts must be an int or None, got True (bool)"),
    ("max_attempts", 0, "RetryPolicy.max_attempts must be positive or None, got 0"),
    ("max_seconds", "60", "RetryPolicy.max_seconds must be a number of seconds or None, "
                          "got '60' (str)"),
    ("max_seconds", NAN, "RetryPolicy.max_seconds must be a number of seconds or None, got nan"),
    ("max_seconds", True, "RetryPolicy.max_seconds must be a number of seconds or None, "
                          "got True (bool)"),
    ("max_seconds", -INF, "RetryPolicy.max_seconds must be positive or None, got -inf"),
    ("max_running_seconds", NAN, "RetryPolicy.max_running_seconds must be a number of seconds "
                                 "or None, got nan"),
    ("max_running_seconds", [5], "RetryPolicy.max_running_seconds must be a number of seconds "
                                 "or None, got [5] (list)"),
    ("backoff", None, "RetryPolicy.backoff must be a number of seconds, got None (NoneType)"),
    ("backoff", False, "RetryPolicy.backoff must be a number of seconds, got False (bool)"),
    ("backoff", NAN, "RetryPolicy.backoff must be a number of seconds, got nan"),
    ("backoff", INF, "RetryPolicy.backoff must be at most 1e+09 seconds, got inf (a wait that "
                     "long never retries, so no bound is ever reached)"),
    # (a finite wait past any the process lives: a bound of attempts was never reached)
    ("backoff", 1e300, "RetryPolicy.backoff must be at most 1e+09 seconds, got 1e+300 (a wait "
                       "that long never retries, so no bound is ever reached)"),
    ("max_backoff", "1s", "RetryPolicy.max_backoff must be a number of seconds, got '1s' (str)"),
    ("max_backoff", INF, "RetryPolicy.max_backoff must be at most 1e+09 seconds, got inf (a "
                         "wait that long never retries, so no bound is ever reached)"),
    ("max_backoff", 1e12, "RetryPolicy.max_backoff must be at most 1e+09 seconds, got "
                          "1000000000000.0 (a wait that long never retries, so no bound is "
                          "ever reached)"),
])
def test_a_bad_field_is_refused_naming_field_and_value(field: str, value: Any,
                                                       message: str) -> None:
    with pytest.raises(ValueError) as refused:
        RetryPolicy(**{field: value})
    assert str(refused.value) == message


def test_an_infinite_bound_is_no_bound_and_reads_as_none() -> None:
    policy = RetryPolicy(max_seconds=INF, max_running_seconds=INF)
    assert policy == RetryPolicy(max_seconds=None, max_running_seconds=None)
    assert not policy.spent(failures=1000, ended_at=0.0, now=1e300)


def test_numbers_of_other_types_are_numbers() -> None:
    policy = RetryPolicy(max_attempts=np.int64(3), max_seconds=Fraction(1, 2), backoff=0,
                         max_backoff=np.float64(0.5))
    assert policy.spent(failures=3, ended_at=0.0, now=0.0)
    assert policy.spent(failures=1, ended_at=0.0, now=0.5)


def test_the_backoff_of_an_unbounded_policy_never_overflows() -> None:
    """Past 1024 failed releases the doubling would overflow a float and raise in the poll."""
    policy = RetryPolicy(max_seconds=None, backoff=0.01, max_backoff=2.0)
    assert policy.next_attempt(failures=5000, now=10.0) == 12.0
    assert policy.next_attempt(failures=1, now=10.0) == 10.01


def test_an_object_store_tier_with_a_running_bound_warns_what_other_processes_may_load(
        caplog: pytest.LogCaptureFixture) -> None:
    """A store given up while NIXL runs it may land mixed bytes that another process sharing
    the bucket loads as a success: said once, where the tier is built with the bound."""
    with caplog.at_level(logging.WARNING, logger="kvfsm"):
        ObjectStoreTier(torch.zeros(4, 64, dtype=torch.uint8), agent=FakeNixlAgent()).shutdown(5)
        assert caplog.records == []
        ObjectStoreTier(torch.zeros(4, 64, dtype=torch.uint8), agent=FakeNixlAgent(),
                        policy=RetryPolicy(max_running_seconds=30)).shutdown(5)
    (record,) = caplog.records
    said = record.getMessage()
    assert "blocks_in_use=True" in said and "must then never be reused" in said
    assert "another process sharing the bucket finds and loads as a success" in said
