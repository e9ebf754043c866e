"""The sidecar page's style and script, served inline (a per-response CSP nonce): nothing is
loaded from elsewhere, so the page works in an air-gapped cluster.

The script only calls the sidecar's own API (``connect-src 'self'``): ``POST
/api/v1/actions/NAME`` with the page's CSRF value in ``X-Dynprof-CSRF`` (the cookie alone is
never enough), then shows the answer: exit code, messages, links to the artifacts, and for
stacks the merged view (ranks grouped by main-thread stack, the odd ones named). Everything
that came from a job (frames, messages, names) is set as text, never as HTML.
"""

from __future__ import annotations

PAGE_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#222}
table{border-collapse:collapse;margin-bottom:1em}td,th{padding:3px 10px;border-bottom:1px solid #ddd;text-align:left}
th{background:#f3f3f3}pre{background:#f7f7f7;padding:1em;overflow:auto}.complete{color:#176f2c}
.partial{color:#9a6700}.failed{color:#b3261e}code{font-size:13px}.ro{font-size:60%;color:#9a6700}
section.job{border:1px solid #ddd;padding:.5em 1em;margin-bottom:1.5em}.acts{margin:.5em 0}
.acts input{width:5em}.result .head{font-weight:600}.result .ok{color:#176f2c}.group{margin:.5em 0}
.group .who{font-weight:600}.group.outlier .who{color:#b3261e}.busy{color:#666}
"""

PAGE_JS = r"""
(function () {
  "use strict";
  var csrf = document.querySelector("meta[name=dynprof-csrf]").content;
  var storeRoot = document.querySelector("meta[name=dynprof-store]").content;

  function el(tag, attrs, children) {
    var node = document.createElement(tag);
    Object.keys(attrs || {}).forEach(function (k) { node.setAttribute(k, attrs[k]); });
    (children || []).forEach(function (c) {
      node.appendChild(typeof c === "string" ? document.createTextNode(c) : c);
    });
    return node;
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
      var frames = el("pre", {}, [(grp.frames || []).map(frameText).join("\n")]);
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
      box.appendChild(el("pre", {"class": "messages"}, [answer.messages.join("\n")]));
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
        row.querySelector("td.step").textContent = a.step === null || a.step === undefined ? "-" : String(a.step);
        row.querySelector("td.state").textContent = String(a.state) + (a.phase ? " (in phase " + a.phase + ")" : "");
        var role = row.querySelector("td.role");
        if (role) { role.textContent = a.role ? String(a.role) : "-"; }
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
        var link = el("a", {href: "/artifact/" + a.id.split("/").map(encodeURIComponent).join("/")}, [a.id]);
        tbody.appendChild(el("tr", {}, [el("td", {}, [link]), el("td", {}, [a.kind]),
          el("td", {"class": a.status}, [a.status]), el("td", {}, [a.created_at]), el("td", {}, [humanBytes(a.bytes)])]));
      });
    });
  }

  function act(section, action) {
    var job = section.getAttribute("data-job");
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
      box.appendChild(el("div", {"class": "head failed"}, [action + ": " + err]));
    }).then(function () { section.setAttribute("data-state", "done"); });
  }

  document.querySelectorAll("section.job button.act").forEach(function (button) {
    button.addEventListener("click", function () {
      act(button.closest("section.job"), button.getAttribute("data-action"));
    });
  });
})();
"""
