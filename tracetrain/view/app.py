"""`tracetrain view`'s pages over one run directory (FastAPI + Jinja2, everything from the package).

    GET /                       the run: config, curves, a table of steps
    GET /step/{n}               a step's rollouts by group; ?state= &cause= &min_reward=
                                &max_reward= &sort= &order=desc
    GET /rollout/{id}           one rollout: turns, what each was sent, every token of its rows
    GET /compare?a=ID&b=ID      two rollouts side by side
    GET /api/status             {"steps": n, "last_step": k}: the run page polls it while training

Pages are rendered with autoescaping: a trace's text is always printed, never run as markup.
A run file that is missing answers 404 and one that cannot be read 503, each with a page naming
the file and the problem (never a stack trace). With `token`, every request must carry it (query
`?token=`, then a cookie).
"""

from __future__ import annotations

import math
import secrets
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from jinja2 import Environment, PackageLoader, select_autoescape

from tracetrain.view.charts import HEIGHT, WIDTH, charts
from tracetrain.view.pages import SORTS, StepQuery, rollout_view, step_table
from tracetrain.view.read import RunDir, RunFileProblem, step_of

HERE = Path(__file__).parent
COOKIE = "tracetrain_view"


def _number(v) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}"
    return str(v)


def create_view_app(run_dir: str | Path, *, token: str | None = None) -> FastAPI:
    run = RunDir(run_dir)
    env = Environment(loader=PackageLoader("tracetrain.view", "templates"),
                      autoescape=select_autoescape(default=True, default_for_string=True))
    env.filters["num"] = _number
    env.filters["short"] = lambda v: "None" if v is None else f"{v:.6g}"
    known: dict = {}  # token pieces seen (tokens.py), for the run's one tokenizer
    app = FastAPI(title="tracetrain view", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    app.state.run = run

    def page(name: str, status: int = 200, **ctx) -> HTMLResponse:
        html = env.get_template(name).render(run_name=run.path.name, run_path=str(run.path), **ctx)
        return HTMLResponse(html, status_code=status)

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        if token is None:
            return await call_next(request)
        given = request.query_params.get("token") or request.cookies.get(COOKIE) or ""
        if not secrets.compare_digest(given.encode(), token.encode()):
            return HTMLResponse("this viewer needs its token: open the URL it printed", 401)
        response = await call_next(request)
        if request.query_params.get("token"):
            response.set_cookie(COOKIE, token, httponly=True, samesite="strict")
        return response

    @app.exception_handler(RunFileProblem)
    async def problem(request: Request, e: RunFileProblem):
        return page("problem.html", 404 if e.missing else 503, problem=e)

    @app.get("/", response_class=HTMLResponse)
    def run_page():
        m = run.metrics()
        problems = list(m.problems)
        try:
            cfg = run.config_json()
        except RunFileProblem as e:
            cfg, problems = None, problems + [str(e)]
        nxt = (m.steps[-1]["step"] + 1) if m.steps else 0
        try:
            running = run.has_step(nxt)
        except RunFileProblem as e:
            running, problems = False, problems + [str(e)]
        return page("run.html", steps=m.steps, charts=charts(m.steps), width=WIDTH, height=HEIGHT,
                    config=cfg, problems=problems, running_step=nxt if running else None)

    @app.get("/api/status")
    def status():
        m = run.metrics()
        return JSONResponse({"steps": len(m.steps),
                             "last_step": m.steps[-1]["step"] if m.steps else None})

    def policies() -> list[str]:
        """The run's policies (config `policies`), in order; [] for a run of one."""
        cfg = run.config()
        return list(cfg.policies) if cfg is not None and cfg.policies else []

    def chosen(policy: str | None) -> str | None:
        """The policy a page explains: the one asked for (ValueError naming it if the run has no
        such policy), else the run's first; None for a run of one policy."""
        names = policies()
        if policy is not None and policy not in names:
            raise ValueError(f"policy {policy!r}: " + (f"this run's policies are {', '.join(names)}"
                                                       if names else "this run has one policy"))
        return policy if policy is not None else (names[0] if names else None)

    @app.get("/step/{step}", response_class=HTMLResponse)
    def step_page(step: int, state: str | None = None, cause: str | None = None,
                  min_reward: str | None = None, max_reward: str | None = None,
                  sort: str = "group", order: str = "asc", policy: str | None = None):
        try:
            policy = chosen(policy)
        except ValueError as e:
            return page("problem.html", 400, problem=str(e))
        if sort not in SORTS:
            return page("problem.html", 400, problem=f"sort must be one of {', '.join(SORTS)}, "
                        f"got {sort!r}")
        bounds = {}
        for name, text in (("min_reward", min_reward), ("max_reward", max_reward)):
            try:  # an empty box is no bound
                bounds[name] = float(text) if text and text.strip() else None
            except ValueError:
                return page("problem.html", 400, problem=f"{name} must be a number, got {text!r}")
        records = run.step_records(step)
        if not records:
            return page("problem.html", 404, problem=f"step {step}: no rollouts in this run's "
                        "trace store")
        explained = run.explained(step, records, policy)
        turns = {r.rollout_id: run.rollout(r.rollout_id)[1] for r in records}
        q = StepQuery(state or None, cause or None, bounds["min_reward"], bounds["max_reward"], sort,
                      order == "desc")
        rows = step_table(records, turns, explained, q)
        metrics = next((m for m in run.metrics().steps if m["step"] == step), None)
        groups: dict[str, list] = {}
        for r in step_table(records, turns, explained, StepQuery()):
            groups.setdefault(r.group_id, []).append(r)
        extremes = {g: (max(rs, key=lambda x: x.reward if x.reward is not None else -math.inf),
                        min(rs, key=lambda x: x.reward if x.reward is not None else math.inf))
                    for g, rs in groups.items() if len(rs) > 1}
        return page("step.html", step=step, rows=rows, total=len(records), explained=explained,
                    q=q, sorts=SORTS, metrics=metrics, extremes=extremes, policies=policies(), policy=policy,
                    causes=sorted({c for r in rows for c in r.breaks}))

    def view_of(rollout_id: str, policy: str | None = None):
        found = run.rollout(rollout_id)
        if found is None:
            return None
        rec, turns = found
        step = None
        n = step_of(rec.group_id)
        if n is not None and rec.state.terminal:
            step = run.explained(n, run.step_records(n), policy)
        cfg = run.config()
        return n, rollout_view(rec, turns, step, run.tokenizer(), known,
                               cfg.role_policies if cfg is not None and cfg.policies else None)

    @app.get("/rollout/{rollout_id}", response_class=HTMLResponse)
    def rollout_page(rollout_id: str, policy: str | None = None):
        try:
            policy = chosen(policy)
        except ValueError as e:
            return page("problem.html", 400, problem=str(e))
        found = view_of(rollout_id, policy)
        if found is None:
            return page("problem.html", 404, problem=f"no rollout {rollout_id!r} in this run")
        n, view = found
        return page("rollout.html", step=n, views=[view], policies=policies(), policy=policy)

    @app.get("/compare", response_class=HTMLResponse)
    def compare_page(a: str, b: str, policy: str | None = None):
        try:
            policy = chosen(policy)
        except ValueError as e:
            return page("problem.html", 400, problem=str(e))
        views, step = [], None
        for rid in (a, b):
            found = view_of(rid, policy)
            if found is None:
                return page("problem.html", 404, problem=f"no rollout {rid!r} in this run")
            step, view = found
            views.append(view)
        return page("rollout.html", step=step, views=views, policies=policies(), policy=policy)

    return app
