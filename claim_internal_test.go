package outbox

import (
	"testing"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// shardDispatcher is a dispatcher that may claim by shard, with batches of
// 100, claiming from shard (-1: every aggregate).
func shardDispatcher(shard int) *Dispatcher {
	d := &Dispatcher{batchSize: 100}
	d.st.ClaimShard = "claim by shard"
	d.shard.Store(int32(shard + 1))
	return d
}

func TestNextShardChoosesWhatTheNextClaimReads(t *testing.T) {
	const someShard = -2 // one of the shards, whichever
	for _, c := range []struct {
		name              string
		shard, seen, took int
		blocked           bool
		want              int // -1: every aggregate
	}{
		{"a full window held back by batches in flight moves to a shard", -1, 100, 60, false, someShard},
		{"a full window held back behind a retry stays with every aggregate", -1, 100, 60, true, -1},
		{"a window that took all stays with every aggregate", -1, 100, 100, false, -1},
		{"a window that was not full stays with every aggregate", -1, 40, 30, false, -1},
		{"a shard with less than a batch due returns to every aggregate", 3, 40, 40, false, -1},
		{"a shard that another claim holds jumps to a shard", 3, 100, 70, false, someShard},
		{"a shard that filled the batch stays", 3, 100, 100, false, 3},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := shardDispatcher(c.shard)
			d.nextShard(c.shard, c.seen, c.took, c.blocked)
			got := int(d.shard.Load()) - 1
			switch {
			case c.want == someShard && (got < 0 || got >= dialect.Shards):
				t.Errorf("next claim reads %d, want one of the %d shards", got, dialect.Shards)
			case c.want != someShard && got != c.want:
				t.Errorf("next claim reads %d, want %d", got, c.want)
			}
		})
	}
}

func TestNextShardMovesOnAfterShardClaimsFullClaims(t *testing.T) {
	d := shardDispatcher(dialect.Shards - 1)
	for i := 1; i < shardClaims; i++ {
		d.nextShard(dialect.Shards-1, 100, 100, false)
		if got := int(d.shard.Load()) - 1; got != dialect.Shards-1 {
			t.Fatalf("after %d full claims the next claim reads %d, want shard %d still", i, got, dialect.Shards-1)
		}
	}
	d.nextShard(dialect.Shards-1, 100, 100, false)
	if got := int(d.shard.Load()) - 1; got != 0 {
		t.Fatalf("after %d full claims the next claim reads %d, want the next shard, 0", shardClaims, got)
	}
	d.nextShard(0, 100, 100, false)
	if got := int(d.shard.Load()) - 1; got != 0 {
		t.Fatalf("the count starts again in a new shard: the next claim reads %d, want 0", got)
	}
}

func TestNextShardLeavesOneEngineWithoutShardsAlone(t *testing.T) {
	d := &Dispatcher{batchSize: 100} // SQLite: no shard statements
	d.nextShard(-1, 100, 60, false)
	if got := d.shard.Load(); got != 0 {
		t.Fatalf("shard = %d, want 0 (every aggregate)", got)
	}
}
