"""Before a run starts, the tracker servers it would log to: an MLflow server (MLFLOW_TRACKING_URI http(s))
must answer, W&B online must have an API key its server accepts. Each is asked once, for at most
TIMEOUT_S seconds, and a problem is one line (exit 2) — where the trackers' own clients would retry in
silence for minutes and then end the run with a long traceback.

The local MLflow store and W&B offline (WANDB_MODE=offline) need nothing: they are not asked.
"""

from __future__ import annotations

import base64
import json
import netrc
import os
import threading
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

from dtrain.errors import ConfigError

TIMEOUT_S = 5.0
WANDB_CLOUD = "https://api.wandb.ai"
OFFLINE = "or set WANDB_MODE=offline (wandb sync uploads the run later)"


def check_servers(names: list[str]) -> None:
    """Refuse, in one line, a tracker whose server does not answer or refuses this run's credentials."""
    if "mlflow" in names:
        _check_mlflow(os.environ.get("MLFLOW_TRACKING_URI", ""))
    if "wandb" in names and _wandb_online():
        _check_wandb(os.environ.get("WANDB_BASE_URL", WANDB_CLOUD).rstrip("/"))


def _check_mlflow(uri: str) -> None:
    if not uri.startswith(("http://", "https://")):
        return  # a local store (run.dir/mlruns, a file: or database URI): nothing to reach
    headers = {}
    if os.environ.get("MLFLOW_TRACKING_TOKEN"):
        headers["Authorization"] = f"Bearer {os.environ['MLFLOW_TRACKING_TOKEN']}"
    elif os.environ.get("MLFLOW_TRACKING_USERNAME"):
        user, password = os.environ["MLFLOW_TRACKING_USERNAME"], os.environ.get("MLFLOW_TRACKING_PASSWORD", "")
        headers["Authorization"] = _basic(user, password)
    problem = _ask(urllib.request.Request(uri.rstrip("/") + "/health", headers=headers))
    if problem is None:
        return
    if problem in ("401", "403"):
        raise ConfigError(
            f"the MLflow server at MLFLOW_TRACKING_URI={uri} refuses these credentials (HTTP {problem}); "
            f"check MLFLOW_TRACKING_USERNAME/MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN"
        )
    raise ConfigError(
        f"no MLflow server answers at MLFLOW_TRACKING_URI={uri} ({_said(problem)}); start it, point "
        f"MLFLOW_TRACKING_URI at one that runs, or unset it to log under run.dir/mlruns"
    )


def _wandb_online() -> bool:
    mode = os.environ.get("WANDB_MODE", "online").strip().lower()
    disabled = os.environ.get("WANDB_DISABLED", "").strip().lower() in ("true", "1", "yes")
    return mode not in ("offline", "dryrun", "disabled") and not disabled


def _check_wandb(base: str) -> None:
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return  # exchanged for credentials by W&B's own client: nothing to check here
    key, source = _wandb_key(base)
    if key is None:
        raise ConfigError(
            f"W&B logs online and finds no API key for {base}: run wandb login or set WANDB_API_KEY, {OFFLINE}"
        )
    viewer = json.dumps({"query": "query Viewer { viewer { id } }"}).encode()
    request = urllib.request.Request(
        f"{base}/graphql",
        data=viewer,
        headers={"Authorization": _basic("api", key), "Content-Type": "application/json"},
    )
    problem = _ask(request)
    if problem is None:
        return
    if problem in ("401", "403"):
        raise ConfigError(
            f"W&B at {base} refuses the API key from {source} (HTTP {problem}); run wandb login --relogin "
            f"with a valid key, {OFFLINE}"
        )
    raise ConfigError(f"W&B at {base} does not answer ({_said(problem)}); check WANDB_BASE_URL, {OFFLINE}")


def _wandb_key(base: str) -> tuple[str | None, str]:
    """The API key W&B's client would use for `base`, and where it is from: WANDB_API_KEY, else the
    netrc file `wandb login` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return os.environ["WANDB_API_KEY"], "WANDB_API_KEY"
    path = Path(os.environ.get("NETRC") or Path.home() / ".netrc")
    try:
        entry = netrc.netrc(str(path)).authenticators(urlsplit(base).netloc)
    except (OSError, netrc.NetrcParseError):
        return None, ""
    return (entry[2], str(path)) if entry and entry[2] else (None, "")


def _basic(user: str, password: str) -> str:
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def _ask(request: urllib.request.Request) -> str | None:
    """None if the server answers 2xx within TIMEOUT_S; else its HTTP status ("401"), or why nothing came.
    Asked in a thread, so that a name that takes long to resolve cannot hold the start up either."""
    answer: list[str | None] = []

    def ask() -> None:
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT_S):
                answer.append(None)
        except urllib.error.HTTPError as exc:
            answer.append(str(exc.code))
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            answer.append(str(reason.strerror if isinstance(reason, OSError) and reason.strerror else reason))

    thread = threading.Thread(target=ask, daemon=True, name="dtrain-tracker-check")
    thread.start()
    thread.join(TIMEOUT_S + 0.5)
    return answer[0] if answer else f"no answer within {TIMEOUT_S:g} s"


def _said(problem: str) -> str:
    return f"HTTP {problem}" if problem.isdigit() else problem
