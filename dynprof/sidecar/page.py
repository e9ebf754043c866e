"""The sidecar page's style and script, served inline (a per-response CSP nonce): nothing is
loaded from elsewhere, so the page works in an air-gapped cluster.

The script only calls the sidecar's own API (``connect-src 'self'``): ``POST
/api/v1/actions/NAME`` with the page's CSRF value in ``X-Dynprof-CSRF`` (the cookie alone is
never enough), then shows the answer: exit code, messages, links to the artifacts, and for
stacks the merged view (ranks grouped by main-thread stack, the odd ones named). Everything
that came from a job (frames, messages, names) is set as text, never as HTML, and first made
one printable line by ``oneLine``, the script's copy of :func:`dynprof.safetext.one_line`
(newlines, controls, bidirectional overrides and every other character Python does not call
printable shown as the same escapes, cut at the same length), as the server-rendered rows are:
a row the script refreshes from the JSON API escapes its text exactly as the server does.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from dynprof.safetext import CUT, MAX_LINE, one_line
from dynprof.sidecar.progress import MIN_STALL_AFTER_S, STALL_STEP_FACTOR
from dynprof.sidecar.progress import stall_after_s as _stall_after_s
from dynprof.units import human_age
from dynprof.watch.model import NodeProgress, RankProgress

STALL_MIN_S = MIN_STALL_AFTER_S
STALL_STEPS = STALL_STEP_FACTOR
"""A rank is *stalled* on the page when its last step is older than the sidecar's stall time:
``serve --stall-after S`` (the hosted watch's, ``serve --watch --stall-after S``) when given,
else the larger of ``STALL_MIN_S`` and ``STALL_STEPS`` times the median step time of its job's
ranks here (the watch's default). The page says which, under the table."""
MAX_VERDICTS_SHOWN = 10
MAX_LIVE_ROWS = 4096

PAGE_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin-bottom:1em}td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left}
th{background:#f3f3f3}pre{background:#f7f7f7;padding:1em;overflow:auto}.complete{color:#176f2c}
.partial{color:#9a6700}.failed{color:#b3261e}code{font-size:13px}.ro{font-size:60%;color:#9a6700}
section.job{border:1px solid #ddd;padding:.5em 1em;margin-bottom:1.5em}.acts{margin:.5em 0}
.acts input{width:5em}.result .head{font-weight:600}.result .ok{color:#176f2c}.group{margin:.5em 0}
.group .who{font-weight:600}.group.outlier .who{color:#b3261e}.busy{color:#666}
.stepping{color:#176f2c}.stalled{color:#b3261e;font-weight:600}.agent-down{color:#b3261e}.starting{color:#666}
.verdicts li{margin:.4em 0}.verdicts .conclusion,.verdict .conclusion{font-weight:600}
"""


@dataclass(frozen=True)
class VerdictItem:
    """One verdict artifact as the page lists it: its id, kind, job, creation time, conclusion."""

    artifact_id: str
    kind: str
    job: str
    created_at: str
    conclusion: str


def stall_after_s(ranks: Sequence[RankProgress], given: float | None = None) -> float:
    """The age past which a rank of these (one job's ranks) is stalled: ``given`` (the
    sidecar's ``--stall-after``) when set, else the default rule (the progress book's)."""
    return _stall_after_s([r.step_time_s for r in ranks], given)


def stall_rule_html(given: float | None) -> str:
    """The rule the table's STATE follows, in words."""
    if given is not None:
        return (
            f"<p class=live-rule>stalled: no step for {given:g} s "
            "(<code>--stall-after</code>, the hosted watch's stall time)</p>"
        )
    return (
        f"<p class=live-rule>stalled: no step for the larger of {STALL_MIN_S:g} s and {STALL_STEPS:g}x the "
        "job's median step time here (the watch's default; <code>serve --watch --stall-after S</code> sets it)</p>"
    )


def live_state(rank: RankProgress, stall_after: float) -> str:
    """``stepping``, ``stalled``, ``agent down`` or ``starting`` (no step yet)."""
    if rank.agent != "up" or rank.process_state in ("zombie", "dead", "gone"):
        return "agent down"
    if rank.last_step_age_s is None:
        return "starting"
    return "stalled" if rank.last_step_age_s > stall_after else "stepping"


def live_html(progress: NodeProgress, stall_after: float | None = None) -> str:
    """The node's ranks, job by job: rank, pid, step, last step's age, step time, state
    (stalled past ``stall_after``, the sidecar's ``--stall-after``, else the default rule),
    and the rule, stated."""
    jobs: dict[str, list[RankProgress]] = {}
    for r in progress.ranks[:MAX_LIVE_ROWS]:
        jobs.setdefault(r.job, []).append(r)
    if not jobs:
        return "<p id=live>no ranks on this node</p>"
    out = [
        "<table id=live><tr><th>JOB</th><th>RANK</th><th>PID</th><th>STEP</th><th>LAST STEP</th>"
        "<th>STEP TIME</th><th>AGENT</th><th>PROCESS</th><th>STATE</th></tr>"
    ]
    for job, ranks in sorted(jobs.items()):
        limit = stall_after_s(ranks, stall_after)
        for r in ranks:
            state = live_state(r, limit)
            age = f"{human_age(r.last_step_age_s)} ago" if r.last_step_age_s is not None else "-"
            step_time = f"{r.step_time_s * 1000:.1f} ms" if r.step_time_s > 0 else "-"
            out.append(
                f"<tr data-live-pid='{int(r.pid)}' data-stall-after='{limit:.3f}'>"
                f"<td>{_text(job or '-')}</td><td>{r.rank if r.rank is not None else '-'}</td>"
                f"<td>{int(r.pid)}</td><td class=live-step>{int(r.step)}</td><td class=live-age>{age}</td>"
                f"<td class=live-time>{step_time}</td><td class=live-agent>{_text(r.agent)}</td>"
                f"<td>{_text(r.process_state)}</td>"
                f"<td class='live-state {state.replace(' ', '-')}'>{state}</td></tr>"
            )
    out.append("</table>")
    out.append(stall_rule_html(stall_after))
    return "".join(out)


def verdicts_html(items: Sequence[VerdictItem]) -> str:
    """The latest verdicts, newest first, each its conclusion first, linked to its artifact."""
    if not items:
        return "<p id=verdicts>no verdicts in this node's store</p>"
    rows = []
    for v in items[:MAX_VERDICTS_SHOWN]:
        href = "/artifact/" + "/".join(_quote(part) for part in v.artifact_id.split("/"))
        rows.append(
            f"<li class='verdict-item {_text(v.kind)}'><div class=conclusion>{_text(v.conclusion)}</div>"
            f"<div>{_text(v.kind)} &middot; job {_text(v.job or '-')} &middot; "
            f"{_text(v.created_at)} &middot; <a href='{html.escape(href)}'>{_text(v.artifact_id)}</a>"
            "</div></li>"
        )
    return f"<ul id=verdicts class=verdicts>{''.join(rows)}</ul>"


def _text(value: object) -> str:
    """What a node or an agent said, for the page: one printable line
    (:func:`dynprof.safetext.one_line`: controls, newlines and bidirectional overrides shown as
    escapes), then escaped for HTML."""
    return html.escape(one_line(value))


def _quote(part: str) -> str:
    return quote(part, safe="")


def verdict_item(artifact_id: str, manifest: dict[str, Any], created_at: str, conclusion: str | None) -> VerdictItem:
    """A verdict artifact's list item: its conclusion from its manifest's summary (or given)."""
    found = manifest.get("summary")
    summary: dict[str, Any] = found if isinstance(found, dict) else {}
    given_kind = summary.get("kind")
    kind = given_kind if isinstance(given_kind, str) else "verdict"
    text = conclusion if conclusion is not None else summary.get("conclusion")
    return VerdictItem(
        artifact_id=artifact_id,
        kind=kind[:40],
        job=str(manifest.get("job") or "")[:200],
        created_at=created_at,
        conclusion=(text if isinstance(text, str) and text else "(no conclusion)")[:4000],
    )


PAGE_JS = r"""
(function () {
  "use strict";
  var csrf = document.querySelector("meta[name=dynprof-csrf]").content;
  var storeRoot = document.querySelector("meta[name=dynprof-store]").content;
  var MAX_LINE = @MAX_LINE@, CUT = "@CUT@";
  var STATUSES = ["complete", "partial", "failed"];
  // What Python's str.isprintable() refuses (Unicode's Other and Separator categories; the
  // space excepted), the bidirectional marks included (they are format characters).
  var UNSAFE = /[\p{C}\p{Z}]/u;
  var SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"};

  function hex(n, width) {
    var h = n.toString(16);
    while (h.length < width) { h = "0" + h; }
    return h;
  }

  function escapeChar(ch) {
    if (SHORT[ch]) { return SHORT[ch]; }
    var code = ch.codePointAt(0);
    if (code >= 0xDC80 && code <= 0xDCFF) { return "\\x" + hex(code - 0xDC00, 2); }
    if (code < 0x100) { return "\\x" + hex(code, 2); }
    if (code < 0x10000) { return "\\u" + hex(code, 4); }
    return "\\U" + hex(code, 8);
  }

  // dynprof.safetext.one_line: a node's text as one printable line, cut at MAX_LINE.
  function oneLine(value) {
    var chars = Array.from(String(value));
    var out = [], size = 0;
    for (var i = 0; i < chars.length; i += 1) {
      var ch = chars[i];
      var piece = (ch === " " || !UNSAFE.test(ch)) ? ch : escapeChar(ch);
      var width = piece === ch ? 1 : piece.length;
      if (size + width > MAX_LINE) { return out.join("") + CUT + "(+" + (chars.length - i) + ")"; }
      out.push(piece);
      size += width;
    }
    return out.join("");
  }

  // Lines of dynprof's own (frames, messages): each one printable line, joined by newlines.
  function lines(values) {
    return document.createTextNode(values.map(oneLine).join("\n"));
  }

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    (children || []).forEach(function (c) {
      node.appendChild(typeof c === "string" ? document.createTextNode(oneLine(c)) : c);
    });
    return node;
  }

  function statusClass(status) {
    return STATUSES.indexOf(status) >= 0 ? status : "";
  }

  function artifactId(path) {
    if (!path) { return null; }
    var root = storeRoot.replace(/\/+$/, "") + "/";
    return path.indexOf(root) === 0 ? path.slice(root.length) : null;
  }

  function artifactLink(path) {
    var id = artifactId(path);
    if (!id) { return el("code", {}, [String(path)]); }
    return el("a", {href: "/artifact/" + id.split("/").map(encodeURIComponent).join("/"), "class": "artifact"}, [id]);
  }

  function frameText(f) {
    var where = f.file ? " (" + f.file + (f.line ? ":" + f.line : "") + ")" : "";
    return (f.native ? "[native] " : "") + f.function + where;
  }

  function stacksView(result) {
    var box = el("div", {"class": "stacks"}, []);
    (result.groups || []).forEach(function (grp, i) {
      var who = grp.label + " (" + grp.size + " process" + (grp.size === 1 ? "" : "es") + ")";
      var head = [el("span", {"class": "who"}, [who]), " " + (grp.headline || "")];
      if (grp.outlier) {
        var odd = (grp.odd && grp.odd.length) ? ": " + grp.odd.join(", ") : "";
        head.push(el("strong", {"class": "failed"}, [" \u2190 odd one out" + odd]));
      }
      if (grp.diverges_at) { head.push(" \u2014 departs at " + frameText(grp.diverges_at)); }
      var frames = el("pre", {}, [lines((grp.frames || []).map(frameText))]);
      var details = el("details", {}, [el("summary", {}, ["main-thread stack"]), frames]);
      box.appendChild(el("div", {"class": "group" + (grp.outlier ? " outlier" : ""), "data-group": String(i)},
                         [el("div", {}, head), details]));
    });
    var failures = result.failures || {};
    Object.keys(failures).forEach(function (k) {
      box.appendChild(el("div", {"class": "failed"}, [k + ": " + failures[k]]));
    });
    return box;
  }

  function agentsView(result) {
    var rows = [el("tr", {}, ["RANK", "ROLE", "NODE", "HOST", "PID", "STEP", "STATE"].map(function (h) {
      return el("th", {}, [h]);
    }))];
    (result.agents || []).forEach(function (a) {
      var state = a.phase ? a.state + " (in phase " + a.phase + ")" : a.state;
      rows.push(el("tr", {}, [a.rank, a.role, a.node, a.host, a.pid, a.step, state].map(function (v) {
        return el("td", {}, [v === null || v === undefined ? "-" : String(v)]);
      })));
    });
    return el("table", {"class": "agents"}, rows);
  }

  function listingView(result) {
    var rows = [el("tr", {}, ["NODE", "ID", "KIND", "STATUS", "RANK", "CREATED", "SIZE"].map(function (h) {
      return el("th", {}, [h]);
    }))];
    (result.artifacts || []).forEach(function (a) {
      var size = typeof a.bytes === "number" ? humanBytes(a.bytes) : "-";
      rows.push(el("tr", {}, [a.node || "this node", a.id, a.kind, a.status, a.rank, a.created_at, size].map(
        function (v) { return el("td", {}, [v === null || v === undefined ? "-" : String(v)]); })));
    });
    return el("table", {"class": "listing"}, rows);
  }

  function nodesView(result) {
    var box = el("div", {"class": "nodes-answers"}, []);
    (result.nodes || []).forEach(function (n) {
      var text = "node " + n.node + ": " + (n.ok ? "ok" : (n.error || ("exit " + n.exit_code)));
      box.appendChild(el("div", {"class": n.ok ? "ok" : "failed"}, [text]));
    });
    return box;
  }

  function artifactsOf(result) {
    var paths = [];
    if (!result) { return paths; }
    if (result.artifact) { paths.push(result.artifact); }
    (result.results || []).forEach(function (r) { if (r && r.artifact) { paths.push(r.artifact); } });
    return paths;
  }

  function show(box, action, status, answer) {
    box.textContent = "";
    if (status !== 200) {
      box.appendChild(el("div", {"class": "head failed"},
                         [action + ": refused (" + status + "): " + ((answer && answer.error) || "no answer")]));
      return;
    }
    var ok = answer.exit_code === 0;
    box.appendChild(el("div", {"class": "head " + (ok ? "ok" : "failed")},
                       [action + ": exit " + answer.exit_code + " in " + answer.elapsed_s + " s on " + answer.host]));
    var jobWide = answer.result && Array.isArray(answer.result.nodes);
    if (jobWide) {
      box.appendChild(nodesView(answer.result));
      var remote = el("ul", {"class": "artifacts"}, []);
      (answer.result.artifacts || []).forEach(function (a) {
        remote.appendChild(el("li", {}, [a.node + ": ", el("code", {}, [String(a.path)])]));
      });
      if (remote.childNodes.length) { box.appendChild(remote); }
    }
    if (action === "ps" && answer.result) { box.appendChild(agentsView(answer.result)); }
    if (action === "ls" && answer.result) { box.appendChild(listingView(answer.result)); }
    var paths = (jobWide || action === "ls") ? [] : artifactsOf(answer.result);
    if (paths.length) {
      var list = el("ul", {"class": "artifacts"}, []);
      paths.forEach(function (p) { list.appendChild(el("li", {}, [artifactLink(p)])); });
      box.appendChild(list);
    }
    if (action === "stacks" && answer.result) { box.appendChild(stacksView(answer.result)); }
    if ((answer.messages || []).length) {
      box.appendChild(el("pre", {"class": "messages"}, [lines(answer.messages)]));
    }
  }

  function humanBytes(n) {
    var units = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i += 1; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  function refreshAgents() {
    return fetch("/api/v1/agents", {credentials: "same-origin"}).then(function (r) {
      return r.ok ? r.json() : null;
    }).then(function (body) {
      if (!body) { return; }
      body.agents.forEach(function (a) {
        var row = document.querySelector("tr[data-pid='" + Number(a.pid) + "']");
        if (!row) { return; }
        row.querySelector("td.step").textContent = a.step === null || a.step === undefined ? "-" : oneLine(a.step);
        row.querySelector("td.state").textContent = oneLine(String(a.state) + (a.phase ? " (in phase " + a.phase + ")" : ""));
        var role = row.querySelector("td.role");
        if (role) { role.textContent = a.role ? oneLine(a.role) : "-"; }
      });
    });
  }

  function refreshArtifacts() {
    return fetch("/api/v1/artifacts?limit=200", {credentials: "same-origin"}).then(function (r) {
      return r.ok ? r.json() : null;
    }).then(function (body) {
      if (!body) { return; }
      var tbody = document.getElementById("artifacts");
      tbody.textContent = "";
      body.artifacts.forEach(function (a) {
        var link = el("a", {href: "/artifact/" + String(a.id).split("/").map(encodeURIComponent).join("/")},
                      [String(a.id)]);
        tbody.appendChild(el("tr", {}, [el("td", {}, [link]), el("td", {}, [String(a.kind)]),
          el("td", {"class": statusClass(a.status)}, [String(a.status)]), el("td", {}, [String(a.created_at)]),
          el("td", {}, [humanBytes(a.bytes)])]));
      });
    });
  }

  function ageText(seconds) {
    var w = Math.max(0, Math.floor(Number(seconds)));
    function two(n) { return (n < 10 ? "0" : "") + n; }
    if (!isFinite(w)) { return "?"; }
    if (w < 60) { return w + "s"; }
    if (w < 3600) { return Math.floor(w / 60) + "m" + two(w % 60) + "s"; }
    if (w < 86400) { return Math.floor(w / 3600) + "h" + two(Math.floor(w % 3600 / 60)) + "m"; }
    return Math.floor(w / 86400) + "d" + two(Math.floor(w % 86400 / 3600)) + "h";
  }

  function refreshLive() {
    if (!document.getElementById("live")) { return Promise.resolve(); }
    return fetch("/api/v1/progress", {credentials: "same-origin"}).then(function (r) {
      return r.ok ? r.json() : null;
    }).then(function (body) {
      if (!body || !Array.isArray(body.ranks)) { return; }
      body.ranks.forEach(function (r) {
        var row = document.querySelector("tr[data-live-pid='" + Number(r.pid) + "']");
        if (!row) { return; }
        var limit = Number(row.getAttribute("data-stall-after")) || 60;
        var age = (typeof r.last_step_age_s === "number") ? r.last_step_age_s : null;
        var state = r.agent !== "up" ? "agent down" : (age === null ? "starting" : (age > limit ? "stalled" : "stepping"));
        row.querySelector("td.live-step").textContent = String(Number(r.step) || 0);
        row.querySelector("td.live-age").textContent = age === null ? "-" : ageText(age) + " ago";
        row.querySelector("td.live-agent").textContent = oneLine(r.agent);
        var cell = row.querySelector("td.live-state");
        cell.textContent = state;
        cell.className = "live-state " + state.replace(" ", "-");
      });
    }).catch(function () { return null; });
  }

  function act(section, action) {
    var job = section.getAttribute("data-job") || "";
    try { job = decodeURIComponent(job); } catch (e) { /* not percent-encoded: as it is */ }
    var options = {};
    if (job) { options.job = job; } else {
      options.pid = section.getAttribute("data-pids").split(",").map(Number);
    }
    var hostsInput = section.querySelector("input.hosts");
    var hosts = hostsInput ? hostsInput.value.split(",").map(function (h) { return h.trim(); })
      .filter(function (h) { return h; }) : [];
    if (hosts.length) { options.hosts = hosts; }
    if (action === "start") {
      var steps = parseInt(section.querySelector("input.steps").value, 10);
      if (!(steps >= 1)) { steps = 1; }
      options.steps = steps;
    }
    var box = section.querySelector(".result");
    box.textContent = "";
    box.appendChild(el("div", {"class": "busy"}, [action + ": running\u2026"]));
    section.setAttribute("data-state", "running");
    var status = 0;
    return fetch("/api/v1/actions/" + action, {
      method: "POST",
      credentials: "same-origin",
      headers: {"Content-Type": "application/json", "X-Dynprof-CSRF": csrf},
      body: JSON.stringify({options: options})
    }).then(function (r) {
      status = r.status;
      return r.json().catch(function () { return null; });
    }).then(function (answer) {
      show(box, action, status, answer);
      return Promise.all([refreshArtifacts(), refreshAgents()]);
    }).catch(function (err) {
      box.textContent = "";
      box.appendChild(el("div", {"class": "head failed"}, [action + ": " + String(err)]));
    }).then(function () { section.setAttribute("data-state", "done"); });
  }

  window.setInterval(refreshLive, 5000);

  document.querySelectorAll("section.job button.act").forEach(function (button) {
    button.addEventListener("click", function () {
      act(button.closest("section.job"), button.getAttribute("data-action"));
    });
  });
})();
""".replace("@MAX_LINE@", str(MAX_LINE)).replace("@CUT@", CUT)
