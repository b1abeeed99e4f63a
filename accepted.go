package outbox

import "sync"

// acceptedSeqs remembers, per aggregate, the highest sequence that this
// dispatcher's publisher accepted and its settle marked delivered. Such an
// event stays accepted whatever happens to its row later (cleanup deletes
// it, a crash of the server forgets the settle's commit and it is
// delivered again), which is all that a claim of the event after it needs:
// a claim takes an event only once the one before was accepted. It spares
// a claim the lookup of that event for the aggregates this dispatcher
// moved last, which with one dispatcher are nearly all of them. It holds
// up to limit aggregates and forgets them all when full, so its memory is
// bounded whatever the number of aggregates; a forgotten one costs a
// lookup.
//
// A sequence names an event only while the database remembers the event:
// a database that forgets committed transactions (a failover to a standby
// that had not received them, a restore to an earlier point, writers that
// commit asynchronously and a crash) gives their sequences to new events.
// Any of those replaces the server, restarts it, or has it recover from a
// crash in place (the crash of one backend), so the memory is kept for
// one start or recovery of the server only (serverStarted): every claim's
// window and lease say when their server last started or recovered
// (dialect.serverStart), and a new one forgets everything. On SQLite the
// database lives in the process, which a crash takes with the memory.
type acceptedSeqs struct {
	mu      sync.Mutex
	limit   int
	seqs    map[aggregateKey]int64
	started string
}

// serverStarted forgets everything unless the server's start is the one
// the memory was built on.
func (c *acceptedSeqs) serverStarted(start string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if start != c.started {
		c.seqs, c.started = nil, start
	}
}

// acceptedLimit is how many aggregates a dispatcher remembers for a batch
// size of n: as many as 128 batches can hold, so that an aggregate whose
// next event comes a hundred batches after its last is still known. An
// aggregate costs about 130 bytes (its names and the map's share): 1.7 MB
// at the default batch size, 17 MB at 1,000. Sixteen batches' worth
// drained 0.83 × the raw loop from a backlog over 100,000 aggregates at
// batch 1,000, sixty-four 0.87 ×, 128 0.94 × (bench, one dispatcher).
func acceptedLimit(n int) int { return max(128*n, 4096) }

// has reports whether the event at seq of k is the last one of k that
// this dispatcher knows to be accepted. (Those before it were accepted
// too, but one of them may be out for a second delivery after a late
// settle: a claim behind it looks it up, and waits for it.)
func (c *acceptedSeqs) has(k aggregateKey, seq int64) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	last, ok := c.seqs[k]
	return ok && last == seq
}

// add records that events were accepted and marked delivered, events
// leased by a server whose start was started: unless that is the start the
// memory is built on, they are not recorded.
func (c *acceptedSeqs) add(events []aggregateSeq, started string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if started != c.started {
		return
	}
	if c.seqs == nil || len(c.seqs)+len(events) > c.limit {
		c.seqs = make(map[aggregateKey]int64, min(c.limit, 2*len(events)))
	}
	for _, e := range events {
		if e.seq > c.seqs[e.agg] {
			c.seqs[e.agg] = e.seq
		}
	}
}
