from engine.cache.demo import demo


def test_demo_prints_the_split_tree_with_lock_counts_and_sizes(capsys):
    demo()
    out = capsys.readouterr().out
    assert "(the edge [6, 7] was split)" in out
    assert "[1, 2] len=2 lock_ref=1" in out
    assert "[7] len=1 lock_ref=0" in out
    assert "#tokens: 12, evictable: 7, protected: 5" in out
