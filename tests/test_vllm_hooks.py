"""The hooks into vLLM's private drafting methods read their arguments by name, and a
vLLM whose methods changed is refused when the hooks are installed (engine start)."""

import pytest
import torch
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner as VllmRunner

from vllm_specexpert import vllm_hooks
from vllm_specexpert.config import SpecExpertUnsupportedError


def unwrapped(method):
    return getattr(method, "__wrapped__", method)


def test_vllms_drafting_methods_have_what_the_lookahead_reads():
    # Fails if DRAFTING_SIGNATURES names a parameter vLLM 0.32 does not have.
    vllm_hooks.check_signature(unwrapped(SpecDecodeBaseProposer.set_inputs_first_pass))
    vllm_hooks.check_signature(unwrapped(VllmRunner.propose_draft_token_ids))


class GPUModelRunner:  # a vLLM whose runner renamed a parameter
    def propose_draft_token_ids(self, scheduler_output, sampled_token_ids, spec_metadata):
        return None


class SpecDecodeBaseProposer_:
    def set_inputs_first_pass(self, target_token_ids) -> tuple[int, "Metadata"]:  # noqa: F821
        return 0, None


SpecDecodeBaseProposer_.set_inputs_first_pass.__qualname__ = (
    "SpecDecodeBaseProposer.set_inputs_first_pass"
)


def test_a_renamed_parameter_is_refused_with_its_name_and_the_fix():
    with pytest.raises(SpecExpertUnsupportedError) as error:
        vllm_hooks.check_signature(GPUModelRunner.propose_draft_token_ids)
    message = str(error.value)
    assert "GPUModelRunner.propose_draft_token_ids: no parameter spec_decode_metadata" in message
    assert "use vLLM 0.32, or remove lookahead" in message


def test_a_changed_return_is_refused():
    with pytest.raises(SpecExpertUnsupportedError, match="set_inputs_first_pass: it returns"):
        vllm_hooks.check_signature(SpecDecodeBaseProposer_.set_inputs_first_pass)


def test_the_drafting_hook_reads_arguments_by_name(monkeypatch):
    # vLLM's own methods, unwrapped, for this test only (restored after it).
    for owner, name in (
        (VllmRunner, "propose_draft_token_ids"),
        (SpecDecodeBaseProposer, "set_inputs_first_pass"),
    ):
        monkeypatch.setattr(owner, name, unwrapped(getattr(owner, name)))
    seen = []

    def propose(runner, draft, scheduler_output, sampled, spec_decode_metadata):
        seen.append((runner, scheduler_output, sampled, spec_decode_metadata))
        return "drafts"

    vllm_hooks.around_drafting(lambda proposer, rows: None, propose)
    runner, output, sampled, metadata = object(), object(), torch.tensor([[1]]), object()
    positional = VllmRunner.propose_draft_token_ids(
        runner, output, sampled, None, None, None, None, metadata, None, None
    )
    keywords = VllmRunner.propose_draft_token_ids(
        runner,
        output,
        sampled_token_ids=sampled,
        sampling_metadata=None,
        hidden_states=None,
        sample_hidden_states=None,
        aux_hidden_states=None,
        spec_decode_metadata=metadata,
        common_attn_metadata=None,
        slot_mappings=None,
    )
    assert positional == keywords == "drafts"
    assert seen == [(runner, output, sampled, metadata)] * 2
