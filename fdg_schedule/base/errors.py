"""Exceptions fdg_schedule raises at run time (config errors live in :mod:`fdg_schedule.base.config`)."""


class FDGRuntimeError(RuntimeError):
    """Something went wrong while a stage ran the FDG schedule; the message names the stage."""


class DataExhausted(StopIteration):
    """The data iterator ran out: every rank drained its in-flight work, then raised this.

    A ``StopIteration``, as stock DeepSpeed's ``train_batch`` raises when the data ends; ``loss``
    is what that last ``train_batch()`` call would have returned.
    """

    def __init__(self, loss: object) -> None:
        super().__init__("the training data ran out; the pipeline was drained on every stage")
        self.loss = loss
