"""Training data for the bundled models (not imported by any service).

Modules: `story_concepts` + `stories` (the synthetic story grammar), `sources` (registry sources,
license allow list, extraction), `concepts` (catalog + lexicon), `labeler`, `tokenizer_build`,
`shards` (writing), `data` (the trainers' loader), `build_data` (the CLI). See train/SOURCES.md.
"""
