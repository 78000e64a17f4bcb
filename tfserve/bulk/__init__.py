"""Bulk translation: a corpus file (or standard input) translated on one machine, through
running servers, or on a Ray cluster (docs/bulk.md).

An integration at the top of the layout (../DESIGN.md §7): a client of the Translator or of a
server, imported by nothing in the serving path (the CLI imports it lazily, for `translate
--input/--output/--ray`). One module per concept:

    records.py   readers (lines, JSON Lines, CSV, Parquet) and writers (lines, JSON Lines)
    batching.py  length-sorted, token-budget batches of a read buffer
    engines.py   what translates a batch: a local Translator, or servers with failover
    journal.py   the resume journal beside the output (fingerprint, offsets, atomic state)
    progress.py  the progress bar or periodic log lines, and the summary line
    job.py       the job loop: read a buffer, batch, translate, write in order, record
    ray_job.py   the Ray Data class for map_batches and the `--ray` job (tfserve[ray])
"""

from tfserve.bulk.job import BadLineError, JobOptions, Summary, run_job

__all__ = ["BadLineError", "JobOptions", "Summary", "run_job"]
