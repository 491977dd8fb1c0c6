"""AgentFlow: the router that turns agents' model calls into token-exact trajectories.

Agents never see tokens. Each trajectory gets a base URL ``{router}/{trajectory_id}/{attempt}/v1``
where an agent calls ``chat/completions`` (OpenAI Chat Completions), ``responses`` (OpenAI
Responses, Codex) or ``messages`` (Anthropic Messages, Claude Code), streaming or not, with tools
or not. The router renders requests with the model's chat template incrementally (token-in,
token-out: earlier model output is reused token for token, never re-tokenized), sends token ids to
rollout engines (SGLang's native ``/generate``), and records per trajectory the tokens, loss
mask, rollout log-probs, weight versions and turn boundaries, as
:class:`~loongsage_hookspecs.Segment` rows.

Main entry points: :class:`AgentFlowRouter` (the server), :func:`run_agent_trajectory` (register,
sandbox, run, collect), :class:`RouterClient` (admin API of a router in another process),
:class:`ChatRenderer` / :class:`ConversationTracker` (the TITO logic, usable without a server).
"""

from .client import RouterClient, RouterClientError
from .conversation import ConversationTracker, TurnPlan
from .errors import RouterError
from .middleware import build_middlewares
from .openai_api import ChatRequest, parse_chat_request
from .record import SamplingDefaults, TrajectoryRecord, TurnInfo
from .router import AgentFlowRouter
from .runner import run_agent_trajectory
from .tito import ChatRenderer, TemplateError, turn_end_token_ids

__all__ = [
    "AgentFlowRouter", "ChatRenderer", "ChatRequest", "ConversationTracker", "RouterClient", "RouterClientError",
    "RouterError", "SamplingDefaults", "TemplateError", "TrajectoryRecord", "TurnInfo", "TurnPlan",
    "build_middlewares", "parse_chat_request", "run_agent_trajectory", "turn_end_token_ids",
]
