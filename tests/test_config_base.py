"""A config file built on others (`base:`), and `$$` for a literal dollar sign (mmrl.core.config)."""

from __future__ import annotations

import warnings

import pytest

from mmrl.core.config import expand_env


def test_two_dollar_signs_are_one(monkeypatch):
    """`$$` writes a literal `$` (a price, a regex that names $HOME); $NAME and ${NAME} are as before."""
    monkeypatch.setenv("MMRL_TEST_HOME", "/h")
    monkeypatch.delenv("MMRL_TEST_UNSET", raising=False)
    data = {"price": "$$5", "literal": "$$MMRL_TEST_HOME", "both": "$$$MMRL_TEST_HOME", "braces": "${MMRL_TEST_HOME}$$",
            "plain": "$MMRL_TEST_HOME/x", "lone": "costs $5", "end": "a$"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "$$MMRL_TEST_UNSET" is no variable: nothing to say
        assert expand_env({**data, "quiet": "$$MMRL_TEST_UNSET"}, "f.yaml") == {
            "price": "$5", "literal": "$MMRL_TEST_HOME", "both": "$/h", "braces": "/h$", "plain": "/h/x",
            "lone": "costs $5", "end": "a$", "quiet": "$MMRL_TEST_UNSET"}
    with pytest.warns(UserWarning, match=r"f.yaml: x names the environment variable \$MMRL_TEST_UNSET, which is not"):
        assert expand_env({"x": "$$-$MMRL_TEST_UNSET"}, "f.yaml") == {"x": "$-$MMRL_TEST_UNSET"}
