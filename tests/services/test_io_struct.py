import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from engine.cache.namespace import PrefixNamespace
from engine.sampling.sampling_params import SamplingParams
from services import io_struct
from services.io_struct import (
    MESSAGE_TYPES,
    AbortReq,
    BatchStrOutput,
    BatchTokenIDOutput,
    DetokenizerReqState,
    FinishReason,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetServerInfoReq,
    GetServerInfoReqOutput,
    Heartbeat,
    Hello,
    LoadLoRAAdapterReq,
    LoRAAdapterReqOutput,
    ProtocolError,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
    WorkerReady,
    decode,
    encode,
)

STAMP = {"sender": "worker", "epoch": io_struct.new_epoch()}


def _batch_columns(n: int) -> dict:
    return {
        "rids": [f"r{i}" for i in range(n)],
        "output_ids": [[i, i + 1] for i in range(n)],
        "finished_reasons": [FinishReason("stop", matched="###")] + [None] * (n - 1),
        "prompt_tokens": [10] * n,
        "completion_tokens": [2] * n,
        "cached_tokens": [4] * n,
        "output_token_logprobs_val": [[-0.5, -1.5]] + [[]] * (n - 1),
        "output_top_logprobs_val": [[[-0.5, -2.0], [-1.5, -3.0]]] + [[]] * (n - 1),
        "output_top_logprobs_idx": [[[7, 8], [9, 10]]] + [[]] * (n - 1),
        "input_token_logprobs_val": [[None, -2.5, -0.25]] + [[]] * (n - 1),
        "input_top_logprobs_val": [[[], [-0.5, -2.5], [-0.25, -4.0]]] + [[]] * (n - 1),
        "input_top_logprobs_idx": [[[], [11, 12], [13, 14]]] + [[]] * (n - 1),
        "spec_verify_ct": [3] + [0] * (n - 1),
        "spec_accept_length": [2.5] + [0.0] * (n - 1),
    }


EXAMPLES = [
    Hello(**STAMP),
    Heartbeat(**STAMP),
    TokenizedGenerateReqInput(
        "r1",
        [1, 2, 3],
        SamplingParams(
            max_new_tokens=5,
            temperature=0.0,
            stop=["\n\n"],
            logit_bias={42: -100.0},
            seed=7,
            json_schema='{"type": "object"}',
            logprobs=True,
            top_logprobs_num=2,
            logprob_start_len=1,
            prompt_top_logprobs_num=3,
        ),
        stream=True,
        extra_key=PrefixNamespace("tenant-a"),
        priority=3,
        routing_key="user-9",
        trace_context={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        **STAMP,
    ),
    AbortReq("r1", **STAMP),
    FlushCacheReq(rid="c1", **STAMP),
    GetServerInfoReq(rid="c2", **STAMP),
    WorkerReady(
        model_path="/models/smollm2",
        served_model_name="smollm2",
        max_total_tokens=8192,
        context_length=2048,
        vocab_size=49152,
        eos_token_ids=[2],
        max_running_requests=64,
        **STAMP,
    ),
    FlushCacheReqOutput(False, "2 requests running", rid="c1", **STAMP),
    LoadLoRAAdapterReq(name="sql", path="/models/sql", rid="c3", **STAMP),
    UnloadLoRAAdapterReq(name="sql", rid="c4", **STAMP),
    LoRAAdapterReqOutput(
        success=False, status=409, message="in use", param="lora_name", lora_adapters={"a": "/a"}
    ),
    GetServerInfoReqOutput(
        {"kv_total_tokens": 8192, "stats": {"hit_rate": 0.5}, "queues": [1, 2]}, rid="c2"
    ),
    BatchTokenIDOutput(
        **_batch_columns(3),
        new_reqs=[DetokenizerReqState("r0", ["###"]), DetokenizerReqState("r1", [], False)],
    ),
    BatchStrOutput(**_batch_columns(3), output_strs=["a", "é", ""], **STAMP),
]


def test_examples_cover_every_message_type():
    assert {type(m) for m in EXAMPLES} == set(MESSAGE_TYPES)


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    decoded = decode(encode(msg))
    assert type(decoded) is type(msg)
    assert decoded == msg


@pytest.mark.parametrize("msg", EXAMPLES, ids=lambda m: type(m).__name__)
def test_wire_form_is_plain_msgpack_tagged_with_the_type_name(msg):
    raw = msgspec.msgpack.decode(encode(msg))
    assert raw["type"] == type(msg).__name__


@given(
    rid=st.text(max_size=20),
    input_ids=st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=50),
    temperature=st.floats(0, 2, allow_nan=False),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    logit_bias=st.dictionaries(st.integers(0, 50_000), st.floats(-100, 100), max_size=3),
    extra_key=st.none() | st.builds(PrefixNamespace, st.text(max_size=10)),
    priority=st.integers(-(2**31), 2**31),
)
def test_generate_request_round_trips_for_any_field_values(
    rid, input_ids, temperature, stop, logit_bias, extra_key, priority
):
    msg = TokenizedGenerateReqInput(
        rid,
        input_ids,
        SamplingParams(temperature=temperature, stop=stop, logit_bias=logit_bias),
        extra_key=extra_key,
        priority=priority,
        **STAMP,
    )
    assert decode(encode(msg)) == msg


@given(
    st.lists(
        st.tuples(
            st.text(max_size=8),
            st.lists(st.integers(0, 2**20), max_size=4),
            st.none()
            | st.builds(
                FinishReason,
                st.sampled_from(["stop", "length", "abort"]),
                st.none() | st.integers(0, 100) | st.text(max_size=4),
                st.none() | st.text(max_size=10),
            ),
            st.text(max_size=8),
        ),
        max_size=5,
    )
)
def test_str_output_round_trips_for_any_batch(rows):
    msg = BatchStrOutput(
        rids=[r[0] for r in rows],
        output_ids=[r[1] for r in rows],
        finished_reasons=[r[2] for r in rows],
        prompt_tokens=[1] * len(rows),
        completion_tokens=[len(r[1]) for r in rows],
        cached_tokens=[0] * len(rows),
        output_strs=[r[3] for r in rows],
    )
    assert decode(encode(msg)) == msg


def test_sampling_params_travel_as_the_engine_dataclass():
    msg = decode(encode(EXAMPLES[2]))
    assert type(msg.sampling_params) is SamplingParams
    assert msg.sampling_params.logit_bias == {42: -100.0}
    params = msg.sampling_params
    assert (params.logprob_start_len, params.prompt_top_logprobs_num) == (1, 3)


def test_engine_finish_reason_encodes_as_the_wire_finish_reason():
    from engine.sched.req import FinishReason as EngineFinishReason

    assert EngineFinishReason is FinishReason  # one definition, sent as is
    columns = _batch_columns(1) | {"finished_reasons": [EngineFinishReason("stop", matched=2)]}
    msg = decode(encode(BatchTokenIDOutput(**columns)))
    assert msg.finished_reasons == [FinishReason("stop", matched=2)]


def test_batch_columns_of_different_lengths_are_rejected_on_construction():
    with pytest.raises(ValueError, match="cached_tokens has 2 entries for 3 rids"):
        BatchStrOutput(**(_batch_columns(3) | {"cached_tokens": [0, 0]}), output_strs=["", "", ""])
    with pytest.raises(
        ValueError, match="output_token_logprobs_val of 'r0' has 1 entries for 2 new tokens"
    ):
        BatchStrOutput(
            **(_batch_columns(3) | {"output_token_logprobs_val": [[-1.0], [], []]}),
            output_strs=["", "", ""],
        )


def test_prompt_logprobs_round_trip_with_none_at_prompt_position_0():
    msg = decode(encode(BatchStrOutput(**_batch_columns(2), output_strs=["", ""])))
    assert msg.input_token_logprobs_val == [[None, -2.5, -0.25], []]
    assert msg.input_top_logprobs_idx == [[[], [11, 12], [13, 14]], []]
    without = {k: v for k, v in _batch_columns(2).items() if not k.startswith("input_")}
    plain = decode(encode(BatchStrOutput(**without, output_strs=["", ""])))
    assert plain.input_token_logprobs_val is None and plain.input_top_logprobs_val is None


@pytest.mark.parametrize(
    ("columns", "error"),
    [
        (
            {"input_token_logprobs_val": [[-1.0]]},
            "input_token_logprobs_val has 1 entries for 2 rids",
        ),
        (
            {"input_top_logprobs_val": [[[-0.5]], []], "input_top_logprobs_idx": [[[3]], []]},
            "input_top_logprobs_val of 'r0' has 1 entries for 3 prompt positions",
        ),
        (
            {"input_top_logprobs_idx": [[[], [11], [13, 14]], []]},
            "input_top_logprobs_idx of 'r0' does not match input_top_logprobs_val",
        ),
        (
            {"input_top_logprobs_idx": None},
            "input_top_logprobs_val and input_top_logprobs_idx come together",
        ),
    ],
)
def test_prompt_logprob_columns_that_do_not_line_up_are_rejected(columns, error):
    with pytest.raises(ValueError, match=error):
        BatchStrOutput(**(_batch_columns(2) | columns), output_strs=["", ""])
    raw = msgspec.msgpack.decode(encode(BatchStrOutput(**_batch_columns(2), output_strs=["", ""])))
    with pytest.raises(ProtocolError):
        decode(msgspec.msgpack.encode(raw | columns))


def test_encode_refuses_what_is_not_a_message():
    with pytest.raises(TypeError, match="not a protocol message"):
        encode({"type": "Hello"})


def _raw(**fields) -> bytes:
    return msgspec.msgpack.encode(fields)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"\xc1", id="reserved-byte"),
        pytest.param(b"not msgpack at all", id="text"),
        pytest.param(encode(EXAMPLES[2])[:-7], id="truncated"),
        pytest.param(encode(EXAMPLES[0]) + b"\x00", id="trailing-bytes"),
        pytest.param(_raw(type="ExecCode", code="import os"), id="unknown-tag"),
        pytest.param(_raw(rid="r1"), id="no-tag"),
        pytest.param(msgspec.msgpack.encode([1, 2, 3]), id="not-a-map"),
        pytest.param(_raw(type="AbortReq"), id="missing-field"),
        pytest.param(_raw(type="AbortReq", rid=5), id="wrong-type"),
        pytest.param(
            _raw(
                type="TokenizedGenerateReqInput",
                rid="r",
                input_ids=[1],
                sampling_params={"max_new_tokens": "many"},
            ),
            id="bad-sampling-param",
        ),
        pytest.param(
            _raw(
                type="BatchStrOutput",
                rids=["a"],
                output_ids=[],
                finished_reasons=[None],
                prompt_tokens=[1],
                completion_tokens=[1],
                cached_tokens=[0],
                output_strs=[""],
            ),
            id="ragged-columns",
        ),
        pytest.param(b"\x81\xa4type" + b"\x91" * 100_000 + b"\x01", id="absurdly-nested"),
    ],
)
def test_bad_bytes_raise_protocol_error(data):
    with pytest.raises(ProtocolError):
        decode(data)


@given(st.binary(max_size=200))
def test_random_bytes_decode_or_raise_protocol_error_only(data):
    try:
        decode(data)
    except ProtocolError:
        pass


@given(st.data())
def test_any_truncation_of_a_valid_message_raises_protocol_error(data):
    wire = encode(data.draw(st.sampled_from(EXAMPLES)))
    cut = data.draw(st.integers(0, len(wire) - 1))
    with pytest.raises(ProtocolError):
        decode(wire[:cut])
