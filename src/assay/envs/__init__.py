"""Environments for multi-turn episodes: the protocol, tools, and the bundled environments.

`ENVS` maps a name to an environment factory (`env: {name: NAME, args: {...}}` in a run
config, or a `module:attr` path to the user's own); docs/agents.md shows how to write one.
"""

from assay.envs.base import ENVS, Environment, EpisodeReward, Step, ToolEnv, env_factory
from assay.envs.calculator import Calculator
from assay.envs.code_fix import CodeFix, CodeFixTask
from assay.envs.sql_agent import SqlAgent, SqlAgentTask
from assay.envs.tools import OUTCOMES, Tool, ToolBox, ToolCall, parse_calls

__all__ = ["ENVS", "Environment", "EpisodeReward", "Step", "ToolEnv", "env_factory", "Calculator", "CodeFix", "CodeFixTask", "SqlAgent", "SqlAgentTask", "OUTCOMES", "Tool", "ToolBox",
           "ToolCall", "parse_calls"]
