"""A check every recurrent mixer shares: under ``generate``, each step reads its own call."""

from __future__ import annotations

import torch


def assert_generate_steps_read_their_own_call(model, mix, prompt: str = "Hello world there") -> None:
    """The spec's generate example: ``seqs == [n, 1, 1]``, ``firsts == [0, 0, 1]``, and each step's states are its own.

    Step 0 is the prompt (its states equal a plain trace's), steps 1 and 2
    one token each; step 2's state is its own ``state_output``, not step 1's.
    """
    with torch.no_grad(), model.trace(prompt):
        prompt_states = mix.states.save()
    firsts, seqs, stacks, outs = [], [], [], []
    with torch.no_grad(), model.generate(prompt, max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for step in tracer.iter[:3]:
            op, first, seq = mix._token_op()
            seqs.append(seq)
            firsts.append(first)
            stacks.append(mix.states.save())
            outs.append(mix.state_output.save())
    assert seqs == [prompt_states.shape[1], 1, 1] and firsts == [0, 0, 1]
    assert torch.equal(stacks[0], prompt_states)
    assert torch.equal(stacks[2][:, 0], outs[2]) and not torch.equal(stacks[2][:, 0], outs[1])
