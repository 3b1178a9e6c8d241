"""Run a training script (argv[1], its arguments after it) with rank 0 late to receive the
other stages' parts of the tied parameters' gradients in every optimizer step: a rank that has
sent its part and finished its last step must not exit before the part is delivered (gloo
moves an isend's data only once its peer posts the receive)."""

import runpy
import sys
import time

from meshplan.runtime.pipeline import PipelineTrainer

_sum_tied = PipelineTrainer._sum_tied


def _late_on_rank_0(self: PipelineTrainer) -> None:
    if self.rank != 0:
        return _sum_tied(self)
    recv = self.p2p.recv

    def late(*args, **kwargs):
        time.sleep(0.5)
        return recv(*args, **kwargs)
    self.p2p.recv = late
    try:
        return _sum_tied(self)
    finally:
        del self.p2p.recv


PipelineTrainer._sum_tied = _late_on_rank_0
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
