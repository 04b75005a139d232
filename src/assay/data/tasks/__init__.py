"""Built-in procedural tasks and their verifiers."""

from assay.data.tasks.arithmetic import Arithmetic, ArithmeticReward, ArithmeticSteps, ArithmeticStepsReward
from assay.data.tasks.base import TASKS, Task, in_heldout, make_task
from assay.data.tasks.countdown import Countdown, CountdownReward, parse_expression
from assay.data.tasks.mix import Mix
from assay.data.tasks.shapes import Shapes  # "shapes": pictures of coloured blocks, for image policies (docs/images.md)
from assay.data.tasks.visual import VisualCount  # "visual_count": a picture and a question, for vision-language policies (docs/multimodal.md)

__all__ = ["TASKS", "Task", "make_task", "in_heldout", "Arithmetic", "ArithmeticReward", "ArithmeticSteps", "ArithmeticStepsReward", "Countdown", "CountdownReward",
           "parse_expression", "Mix", "Shapes", "VisualCount"]
