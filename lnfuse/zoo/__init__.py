"""Many models in one run: ``lnfuse a.onnx dir/ 'zoo/**/*.onnx' -o OUT`` on all cores or on a Ray cluster.

The data's path: ``inputs`` expands the arguments into one ``Job`` per model and mirrors the input tree under the
output folder; ``ledger`` says which of them a previous run already finished (``identity``: stat keys and content
hashes); ``local`` (worker processes) or ``ray_runner`` (long-lived Ray actors) runs ``job.run`` on the rest, each
model under its own time and memory limit; each row goes to the ledger as it finishes and ``progress`` draws it;
``table`` prints the closing table and the exit code comes from the rows. ``command`` ties them together for the
CLI, which imports only ``options`` until a zoo runs.
"""
