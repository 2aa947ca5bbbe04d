import gc

from kestrel.utils.collector import freeze_startup_objects


def test_freeze_moves_live_objects_out_of_the_collectors_walk():
    keep = [{"n": i} for i in range(1000)]  # tracked containers alive at "startup"
    try:
        frozen = freeze_startup_objects()
        assert frozen >= len(keep) and gc.get_freeze_count() == frozen
        assert not any(gc.is_tracked(o) and o in gc.get_objects(generation=2) for o in keep[:3])
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
