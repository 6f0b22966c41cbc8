"""The ``torch_distribute`` logger: no handler of its own, its level from ``TD_LOG_LEVEL`` or
``td.config.set_log_level``; INFO says what a strategy decided. (The 2-worker records, with
each collective at DEBUG, are checked in ``tests/test_loss_scaling_check.py``'s job.)"""

from __future__ import annotations

import importlib
import logging

import pytest

import torch_distribute as td
from torch_distribute import log

pytestmark = pytest.mark.timeout(120)


def test_no_handler_and_the_level_from_config(caplog):
    logger = logging.getLogger("torch_distribute")
    try:
        td.config.set_log_level("INFO")
        assert logger.level == logging.INFO
        with caplog.at_level(logging.INFO, logger="torch_distribute"):
            td.CentralStorageStrategy(["cpu:0", "cpu:1"])
        assert logger.handlers == []  # the library adds none
        (message,) = [r.getMessage() for r in caplog.records if r.name == "torch_distribute.strategies"]
        assert message == ("CentralStorageStrategy: 2 replica(s) in sync = 1 worker(s) x 2 local replica(s) on "
                           "cpu:0, cpu:1 (parameters on cpu:0) (cross-device ops: ReductionToOneDevice); this "
                           "process is worker 0 (the chief)")
        with pytest.raises(td.InvalidArgumentError, match="logging level"):
            td.config.set_log_level("LOUD")
    finally:
        td.config.set_log_level(logging.NOTSET)


def test_level_from_the_environment(monkeypatch):
    """``TD_LOG_LEVEL`` is read when the module is imported (reloaded here, in-process)."""
    logger = logging.getLogger("torch_distribute")
    try:
        for value, expected in (("DEBUG", logging.DEBUG), ("info", logging.INFO), ("30", logging.WARNING)):
            monkeypatch.setenv("TD_LOG_LEVEL", value)
            importlib.reload(log)
            assert logger.level == expected, value
        logger.setLevel(logging.NOTSET)
        monkeypatch.setenv("TD_LOG_LEVEL", "LOUD")
        with pytest.warns(UserWarning, match="TD_LOG_LEVEL='LOUD' is not a logging level"):
            importlib.reload(log)
        assert logger.level == logging.NOTSET
    finally:
        logger.setLevel(logging.NOTSET)
