"""Other servers, seen through their HTTP interfaces: /metrics read as a snapshot-like record
(scrape.py), a timeline of those records (timeline.py), and request traces sent to OpenAI-compatible
endpoints (loadgen.py). Only the URLs the user gives are contacted."""
