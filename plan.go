package outbox

import "math/bits"

// Plans of the dispatcher's statements.
//
// The window reads, the lease, the settle, parking and the sweeps find
// their rows through the primary key, the due index or the aggregate
// index, which suits a table of any size, provided the database plans
// them for the table it has. pgx, GORM's PostgreSQL driver, prepares each
// statement once per connection and keeps it by its text (as GORM's
// PrepareStmt does), and from a prepared statement's sixth run on
// PostgreSQL may keep one plan for all arguments (when, as is usual for
// these statements, its estimated cost is not above that of the plans
// made for the first five runs' arguments), made from what it knew of the
// table then. Made while the table was nearly empty, that plan reads all
// of it (seen: a sequential scan for the lease, a bitmap scan of every due
// row for the settle), and goes on doing so as the table grows, until the
// table is next analysed or vacuumed, which with autovacuum off is never:
// on a table of 40,000 rows, most of them delivered or not yet due,
// dispatching two events touched 1,692 blocks of the table and its
// indexes instead of 88.
//
// So on PostgreSQL the text of these statements starts with a comment
// naming the power of two above the highest row id the dispatcher has
// read (dialect.planComment). When that doubles, the driver prepares them
// anew, and the database plans them for the table as it is now: about
// once per doubling of the ids, that is some thirty times over a billion
// events, most of them in the first minutes of a table that starts empty,
// and once or twice for a dispatcher that starts on a grown table. Once
// the table is big enough for an index to beat reading it whole, each new
// plan keeps to the index. A plan made for a small table serves until the
// ids double, while the table may grow by as many rows; that matters only
// where the ids are large and the table small, as after Cleanup emptied
// it: a plan made then may read the table whole until the ids double
// again, or the table is analysed. Planning every run instead (unnamed
// statements) cost every lease and settle about 0.35 ms on the benchmark
// machine, a tenth of a 100-row batch.
//
// The sweeps' statements carry the comment too, with the ids that claims
// read. A dispatcher that only sweeps (a Scheduler without dispatch) keeps
// its first plans; made on a small table, those were seen to keep to their
// indexes as it grew (TestPostgresSweepsReadLittleOfATableThatGrew).

// sawID records that the dispatcher read the row id.
func (d *Dispatcher) sawID(id int64) {
	for {
		seen := d.readID.Load()
		if id <= seen || d.readID.CompareAndSwap(seen, id) {
			return
		}
	}
}

// planTag is what leads the text of the statements named above (not the
// order check's lookup, nor Stats): on PostgreSQL, a comment that changes
// each time the highest row id the dispatcher's claims have read doubles.
func (d *Dispatcher) planTag() string {
	return d.d.planComment(bits.Len64(uint64(d.readID.Load())))
}
