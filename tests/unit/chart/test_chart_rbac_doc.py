"""docs/gke.md's tables of what each install mode may do are the chart's own RBAC, rendered by
helm: this test fails when they drift (TPUSYNC_UPDATE_GOLDEN=1 rewrites them; read the diff)."""

from __future__ import annotations

import os
import re
from typing import Any

from harness import REPO
from harness.helm import find

DOC = REPO / "docs" / "gke.md"
UPDATE = os.environ.get("TPUSYNC_UPDATE_GOLDEN") == "1"


def table(rules: list[dict[str, Any]]) -> str:
    lines = ["| API group | resources | verbs |", "|---|---|---|"]
    for r in rules:
        if "nonResourceURLs" in r:
            lines.append(f"| (discovery) | {', '.join(r['nonResourceURLs'])} | {', '.join(r['verbs'])} |")
            continue
        groups = ", ".join(g or "core" for g in r["apiGroups"])
        lines.append(f"| {groups} | {', '.join(r['resources'])} | {', '.join(r['verbs'])} |")
    return "\n".join(lines)


def sections(helm) -> dict[str, str]:
    wide = helm.template()
    scoped = helm.template({"watchNamespaces": ["team-a", "team-b"]})
    return {
        "cluster-wide": "ClusterRole, bound cluster-wide:\n\n" + table(find(wide, "ClusterRole")["rules"]),
        "namespaced": ("ClusterRole (cluster-scoped reads only):\n\n" + table(find(scoped, "ClusterRole")["rules"])
                       + "\n\nRole, in each watched namespace (team-a, team-b here):\n\n"
                       + table(find(scoped, "Role", namespace="team-a")["rules"])),
    }


def test_the_guides_permission_tables_are_the_charts(helm):
    text = DOC.read_text()
    for name, table_text in sections(helm).items():
        body = table_text + "\n"
        pattern = re.compile(rf"(<!-- rbac:{name} \(generated: tests/unit/chart/test_chart_rbac_doc.py\) -->\n)"
                             rf"(.*?)(<!-- /rbac:{name} -->)", re.S)
        m = pattern.search(text)
        assert m, f"docs/gke.md has no rbac:{name} block"
        if UPDATE:
            text = text[:m.start(2)] + body + text[m.end(2):]
        else:
            assert m.group(2) == body, f"docs/gke.md's rbac:{name} table is not the chart's: TPUSYNC_UPDATE_GOLDEN=1"
    if UPDATE:
        DOC.write_text(text)
