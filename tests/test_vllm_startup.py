"""Reading vLLM's start-up phases from the log file terra routes its INFO records to."""

import logging.config

from terra_cli.backends.vllm_startup import read_phases, routing_config


def test_phases_cache_verdict_and_window(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text(
        "99.000 Loading weights took 9.00 s\n"  # before the window: another engine
        "100.500 Loading weights took 2.10 s\n"
        "101.000 Compiling a graph for compile range (1, 8192) takes 4.00 s\n"
        "a continuation line\n"
        "106.000 torch.compile took 19.60 s in total\n"
        "108.250 Graph capturing finished in 2 secs, took 0.50 GiB\n"
        "121.000 init engine (profile, create kv cache, warmup model) took 13.40 s\n"
    )
    phases = read_phases(log, since=100.0, until=130.0)
    assert phases["weights_s"] == 2.1 and phases["compile_s"] == 19.6
    assert phases["graph_capture_s"] == 2.0 and phases["engine_init_s"] == 13.4
    assert phases["compile_cache"] == "miss"
    assert phases["timeline"][0] == [0.5, "Loading weights took 2.10 s"]

    log.write_text("100.1 Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 0.9 s\n"
                   "100.2 torch.compile took 4.50 s in total\n")
    assert read_phases(log, 100.0, 101.0)["compile_cache"] == "hit"
    assert read_phases(tmp_path / "absent.log", 0, 1)["note"]


def test_routing_keeps_the_console_quiet_and_the_file_complete(tmp_path, capsys):
    log = tmp_path / "vllm.log"
    logging.config.dictConfig(routing_config(log, "WARNING"))
    try:
        logger = logging.getLogger("vllm.terra_routing_test")
        logger.info("Loading weights took 1.50 s")
        logger.warning("a warning")
    finally:
        logging.getLogger("vllm").handlers.clear()
    said = capsys.readouterr()
    assert "Loading weights" not in said.out + said.err and "a warning" in said.out
    assert "Loading weights took 1.50 s" in log.read_text() and "a warning" in log.read_text()


def test_known_noise_stays_off_the_console_unless_info_is_asked_for(tmp_path, capsys):
    log = tmp_path / "vllm.log"
    for level, shown in (("WARNING", False), ("INFO", True)):
        logging.config.dictConfig(routing_config(log, level))
        try:
            logger = logging.getLogger("vllm.renderers.base")
            try:
                raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
            except ValueError:
                logger.warning("Chat template warmup failed", exc_info=True)
            logger.warning("Using None for %s token id because tokenizer is not initialized", "EOS")
            logger.warning("This model does not officially support disabling chunked prefill. Disabling this "
                           "manually may cause the engine to crash or produce incorrect outputs.")
            logger.warning("Triton kernel JIT compilation during inference: _paged_attention. This causes a latency "
                           "spike; consider extending warmup to cover this shape/config.")
            logger.warning("a real problem")
        finally:
            logging.getLogger("vllm").handlers.clear()
        said = capsys.readouterr().out
        assert "a real problem" in said
        assert ("Chat template warmup failed" in said) is shown
        assert ("Traceback" in said) is shown and ("token id because" in said) is shown
        assert ("chunked prefill" in said) is shown and ("JIT compilation" in said) is shown
    assert log.read_text().count("Chat template warmup failed") == 2  # the file keeps everything
