"""``lnfuse explain model.onnx --annotate out.onnx``: an unchanged copy of the input in which the nodes of each
candidate carry what lnfuse decided (open it in Netron and click the node that stopped a fusion)."""

from __future__ import annotations

import os

from lnfuse.load import io
from lnfuse.save import write
from lnfuse.index.scopes import scopes
from lnfuse.save.provenance import mark_candidates
from lnfuse.report import Report


def write_annotated(source: str | os.PathLike, report: Report, output: str | os.PathLike,
                    report_file: str | os.PathLike | None = None) -> int:
    """Read ``source`` again (the report's run rewrote its own copy), label its candidates' nodes from ``report``
    and write it like any output: atomically, weights copied byte for byte, and ``report`` as JSON to
    ``report_file`` if given (renamed into place with the copy). Returns the nodes labelled."""
    loaded = io.load(source, defer_symbolic=True)  # labels need no shapes: ORT's inference is never asked
    labelled = mark_candidates(loaded.model, report, {scope.path: scope.graph for scope in scopes(loaded.model)})
    write.strip_inferred_value_info(loaded.model, loaded.declared_value_info, loaded.claims)
    write.save(loaded.model, output, external_data="keep" if loaded.has_external_data else None,
            input_path=loaded.path, source=loaded.source,
            report=(report_file, report.to_json()) if report_file is not None else None)
    return labelled
