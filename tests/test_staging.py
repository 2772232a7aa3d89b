"""fdg_schedule.runtime.staging: DeepSpeed's own pipeline sends through host memory where gloo moves accelerator
tensors.

CUDA cannot run here: the tensors that need staging are picked by a stand-in, and DeepSpeed's ``p2p.send`` /
``p2p.recv`` are recorders; the path decision is the real one (gloo with a CUDA stage: STAGED).
"""

from __future__ import annotations

import torch
from deepspeed.runtime.pipe import p2p

from fdg_schedule.runtime import staging


def test_deepspeeds_sends_go_through_host_memory_on_the_staged_path(one_rank_group, monkeypatch) -> None:
    sent, received_into = [], []

    def send(tensor, dest_stage, async_op=False):
        sent.append((tensor, dest_stage))

    def recv(tensor, src_stage, async_op=False):
        received_into.append(tensor)
        tensor.fill_(7.0)  # what the previous stage sent

    monkeypatch.setattr(p2p, "send", send)
    monkeypatch.setattr(p2p, "recv", recv)
    assert not staging.install(torch.device("cpu"))  # a stage in host memory: DeepSpeed's functions stay
    assert p2p.send is send
    device_tensors: list[torch.Tensor] = []  # stand-ins for tensors on the GPU
    assert staging.install(torch.device("cuda"), needs=lambda t: any(t is d for d in device_tensors))
    staged_send = p2p.send
    assert staging.install(torch.device("cuda")) and p2p.send is staged_send  # installed once
    loss, plain = torch.tensor([0.5]), torch.tensor([1.0])
    device_tensors.append(loss)
    p2p.send(loss, 1)
    p2p.send(plain, 1)
    assert sent[0][0].device.type == "cpu" and torch.equal(sent[0][0], loss) and sent[1][0] is plain
    into = torch.zeros(2)
    device_tensors.append(into)
    p2p.recv(into, 0)
    assert received_into[0] is not into and received_into[0].device.type == "cpu"  # a host buffer, copied back
    assert torch.equal(into, torch.full((2,), 7.0))
    p2p.recv(plain, 0)
    assert received_into[1] is plain
