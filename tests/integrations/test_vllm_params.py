"""D's check of the transfer params it receives (kvflow.integrations.vllm.params): params that
do not describe D's own prompt, or are malformed, are refused with the field and value named,
so D computes the prompt itself instead of decoding another prompt's KV (no vLLM needed)."""

from __future__ import annotations

import pytest

from kvflow.integrations.vllm.params import check_params, prompt_hash

PROMPT = list(range(100, 136))  # 36 tokens: 2 blocks of 32


def good(**kw) -> dict:
    base = {"do_remote_prefill": True, "remote_addr": "tcp://127.0.0.1:5601",
            "remote_request_id": "cmpl-1", "remote_block_ids": [4, 9],
            "remote_num_tokens": 36, "remote_prompt_hash": prompt_hash(PROMPT)}
    return {**base, **kw}


def test_params_of_this_prompt_pass():
    assert check_params(good(), PROMPT, 32) == ""
    assert prompt_hash(PROMPT) != prompt_hash(PROMPT[::-1]) != prompt_hash(PROMPT[:-1])


@pytest.mark.parametrize("change, message", [
    ({"remote_addr": "not-an-addr"}, "remote_addr must be 'tcp://host:port', got 'not-an-addr'"),
    ({"remote_addr": None}, "remote_addr must be 'tcp://host:port', got None"),
    ({"remote_request_id": 7}, "remote_request_id must be a string, got 7"),
    ({"remote_block_ids": [-1, 3]},
     "remote_block_ids must be a list of block ids in [0, 2**31), got [-1, 3]"),
    ({"remote_block_ids": [1, 2**31]},
     "remote_block_ids must be a list of block ids in [0, 2**31), got [1, 2147483648]"),
    ({"remote_block_ids": [1, True]},
     "remote_block_ids must be a list of block ids in [0, 2**31), got [1, True]"),
    ({"remote_block_ids": "1,2"},
     "remote_block_ids must be a list of block ids in [0, 2**31), got '1,2'"),
    ({"remote_block_ids": [1]}, "remote_block_ids holds 1 block ids; a 36-token prompt fills 2 "
                                "blocks of 32"),
    ({"remote_block_ids": [1, 2, 3]}, "remote_block_ids holds 3 block ids; a 36-token prompt "
                                      "fills 2 blocks of 32"),
    ({"remote_num_tokens": 96}, "remote_num_tokens is 96 but this prompt has 36 tokens: the "
                                "params are another prompt's"),
])
def test_malformed_or_foreign_params_are_refused_by_field(change, message):
    assert check_params(good(**change), PROMPT, 32) == message


def test_another_prompt_of_the_same_length_is_refused():
    other = PROMPT[::-1]
    assert check_params(good(), other, 32) == (
        f"remote_prompt_hash {prompt_hash(PROMPT)!r} is not this prompt's "
        f"{prompt_hash(other)!r}: the params are another prompt's")
    params = good()
    del params["remote_prompt_hash"]  # a P without the hash (or a hand-written request)
    assert check_params(params, PROMPT, 32).startswith("remote_prompt_hash None is not")
