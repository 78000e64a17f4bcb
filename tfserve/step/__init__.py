"""The step contract between the searches (`tfserve.generation`) and the backends that run a
decoder step (`tfserve.runtime`, `tfserve.model.eager`): `tfserve.step.contract`. It sits
below both and imports numpy only."""

from tfserve.step.contract import (
    Backend,
    Cache,
    RowCutter,
    SampleDraws,
    StepOutput,
    narrow_first,
)

__all__ = ["Backend", "Cache", "RowCutter", "SampleDraws", "StepOutput", "narrow_first"]
