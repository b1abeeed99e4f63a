package outbox

import (
	"math/bits"
	"strconv"
)

// Plans of the dispatcher's writes.
//
// The lease, the settle, parking and the sweeps find their rows by primary
// key or by aggregate, which suits a table of any size, provided the
// database plans them for the table it has. pgx, GORM's PostgreSQL driver,
// prepares each statement once per connection and caches it by its text
// (as GORM's PrepareStmt does with any driver), and PostgreSQL plans a
// prepared statement once for all its arguments from its sixth run on,
// from what it knows of the table at that time. Made while the table was
// nearly empty, that plan reads all of it (seen: a sequential scan for the
// lease, a bitmap scan of every due row for the settle), and goes on doing
// so as the table grows, until the table is next analysed, which with
// autovacuum off is never: a table of 40,000 rows, most of them delivered
// or not yet due, had the dispatch of one event touch 1,651 of its blocks
// instead of 44.
//
// So the text of each write starts with a comment naming the power of two
// above the highest row id the dispatcher has claimed. When that doubles,
// the driver prepares the write anew, and the database plans it for the
// table as it is now. A plan thus serves at most until the ids the
// dispatcher claims have doubled since it was made; once the table is
// big enough for its primary key to beat reading it whole, each new plan
// keeps to the primary key. A dispatcher prepares its writes anew a few
// dozen times in its life, most of them in its first batches. Planning
// every run instead (unnamed statements) cost every lease and settle
// about 0.35 ms on the benchmark machine, a tenth of a 100-row batch.

// sawID records that a claim read the row id.
func (d *Dispatcher) sawID(id int64) {
	for {
		seen := d.claimedID.Load()
		if id <= seen || d.claimedID.CompareAndSwap(seen, id) {
			return
		}
	}
}

// planTag is the comment that leads the text of the dispatcher's writes:
// it changes each time the highest row id the dispatcher has claimed
// doubles.
func (d *Dispatcher) planTag() string {
	return "/* outbox: ids below 2^" + strconv.Itoa(bits.Len64(uint64(d.claimedID.Load()))) + " */ "
}
