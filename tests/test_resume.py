

def test_the_resume_notice_says_what_changed_and_what_became_of_the_global_batch():
    """2 processes x accumulation 1 resumed as 1 x 2 said "the global batch is now 4" where it had
    been 4; a strategy change at the same world size said nothing."""
    from latentloop.train.resume import layout_change

    same = {"world_size": 2, "strategy": "ddp", "global_batch": 4}
    assert layout_change(same, 2, "ddp", 4) is None
    assert layout_change(same, 1, "none", 4) == (
        "resuming a run saved by 2 process(es), resumed on 1, strategy ddp -> none: the global batch stays 4 "
        "sequences, and the run does not continue bit-exactly")
    assert "strategy ddp -> fsdp2: the global batch stays 4" in layout_change(same, 2, "fsdp2", 4)
    assert "goes from 4 to 8 sequences" in layout_change(same, 4, "ddp", 8)
    old = {"world_size": 2, "strategy": None, "global_batch": None}  # a checkpoint that did not record them
    assert layout_change(old, 1, "none", 4).endswith("the global batch is now 4 sequences, and the run does not "
                                                     "continue bit-exactly")
