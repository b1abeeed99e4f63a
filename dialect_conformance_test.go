package outbox

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox/internal/outboxtest"

	"github.com/gorm-outbox/outbox/internal/dialect"
)

// TestDialectConformance is the contract of the dialect seam
// (internal/dialect): every method of Dialect, and every statement an engine returns, called
// directly with plain values on a fresh database of each engine and held
// to what its doc comment says. The behaviour suite tests the library
// through the plugin and the dispatcher; this test pins the seam beneath
// them, so that a change to an engine, or a new one, shows here which
// promise of the seam it breaks.
func TestDialectConformance(t *testing.T) {
	for _, e := range outboxtest.Engines {
		t.Run(string(e), func(t *testing.T) {
			t.Parallel()
			run := func(t *testing.T, checks []conformanceCheck) {
				for _, ch := range checks {
					t.Run(ch.name, func(t *testing.T) {
						t.Parallel()
						ch.check(t, openConformance(t, e))
					})
				}
			}
			run(t, methodChecks)
			t.Run("Statements", func(t *testing.T) { run(t, statementChecks) })
		})
	}
}

// conformanceCheck is one method or statement of the seam, checked on a
// database of its own.
type conformanceCheck struct {
	name  string
	check func(t *testing.T, c *conformance)
}

var methodChecks = []conformanceCheck{
	{"Name", checkName},
	{"Tables", checkTables},
	{"Bind", checkBind},
	{"TimeArg", checkTimeArg},
	{"ReadTime", checkReadTime},
	{"ReturnsRows", checkReturnsRows},
	{"InsertedColumn", checkInsertedColumn},
	{"ErrorAbortsTx", checkErrorAbortsTx},
	{"IDList", checkIDList},
	{"TextList", checkTextList},
	{"EventList", checkEventList},
	{"ClaimTx", checkClaimTx},
	{"MigrateTx", checkMigrateTx},
	{"Listen", checkListen},
	{"CheckPool", checkCheckPool},
	{"LockConflict", checkLockConflict},
	{"RejectsData", checkRejectsData},
	{"InsertEvent", checkInsertEvent},
}

var statementChecks = []conformanceCheck{
	{"Claim", checkClaim},
	{"Window", checkWindow},
	{"Shards", checkShards},
	{"ShardWindowPlan", checkShardWindowPlan},
	{"Undelivered", checkUndelivered},
	{"Lease", checkLease},
	{"SettleDelivered", checkSettleDelivered},
	{"SettleOther", checkSettleOther},
	{"Blockers", checkBlockers},
	{"Park", checkPark},
	{"Unpark", checkUnpark},
	{"Revive", checkRevive},
	{"Requeue", checkRequeue},
	{"Cleanup", checkCleanup},
	{"Counts", checkCounts},
	{"OldestDue", checkOldestDue},
	{"LastFailure", checkLastFailure},
}

// conformanceTable is the table every check runs on: a reserved word in
// mixed case, so that a statement that forgets to quote a name fails.
const conformanceTable = "Order"

// conformance is what a check gets: a fresh database on one engine with
// the outbox tables migrated, its dialect, and one time, now, that the
// check's rows and statements are placed around.
type conformance struct {
	e    outboxtest.Engine
	db   *gorm.DB
	info outboxtest.DB
	d    dialect.Dialect
	tb   dialect.Tables
	st   dialect.Statements
	now  time.Time
	n    int // events written
}

func openConformance(t *testing.T, e outboxtest.Engine) *conformance {
	t.Helper()
	db, info := outboxtest.Open(t, e, nil)
	if err := db.Use(Plugin(WithTable(conformanceTable))); err != nil {
		t.Fatal(err)
	}
	if err := AutoMigrate(db); err != nil {
		t.Fatal(err)
	}
	d, err := dialect.For(db)
	if err != nil {
		t.Fatal(err)
	}
	tb := d.Tables(conformanceTable)
	return &conformance{e: e, db: db, info: info, d: d, tb: tb, st: d.Statements(tb),
		now: time.Now().UTC().Truncate(time.Microsecond)}
}

// ctx is the context of the checks' calls.
var ctx = context.Background()

func (c *conformance) ago(d time.Duration) time.Time { return c.now.Add(-d) }
func (c *conformance) in(d time.Duration) time.Time  { return c.now.Add(d) }
func (c *conformance) ts(t time.Time) any            { return c.d.TimeArg(t) }

// rowLocks reports whether claims lock rows (PostgreSQL, MySQL) rather
// than the whole database (SQLite): the lock statement is empty where
// ClaimTx holds the database.
func (c *conformance) rowLocks() bool { return c.e != outboxtest.SQLite }

func (c *conformance) pool() gorm.ConnPool { return c.db.Statement.ConnPool }

// lockOldest reads and locks up to limit of the oldest claimable rows, in
// q's claim transaction, skipping rows another claim holds: the engine's
// window, or where the claim is one statement, the read its window makes.
func (c *conformance) lockOldest(q dialect.Querier, limit int) ([]windowRow, error) {
	if c.st.Window != "" {
		return queryRows(ctx, q, c.st.Window, c.ts(c.now), limit)
	}
	return queryRows(ctx, q, c.sql(`SELECT id, aggregate_type, aggregate_id, aggregate_sequence FROM {records}
WHERE delivery_state IN ('pending', 'retry', 'delivering') AND next_attempt_at <= ?
	AND (locked_until IS NULL OR locked_until <= ?)
ORDER BY next_attempt_at, id LIMIT ? FOR UPDATE SKIP LOCKED`), c.ts(c.now), c.ts(c.now), limit)
}

// markDelivering changes row id in q's claim transaction, as a lease would.
func (c *conformance) markDelivering(q dialect.Querier, id int64) error {
	_, err := q.ExecContext(ctx, c.sql(`UPDATE {records} SET delivery_state = 'delivering', batch_id = 'b1' WHERE id = ?`), id)
	return err
}

// queryIDs reads a one-column result of ids.
func queryIDs(ctx context.Context, q dialect.Querier, query string, args ...any) (map[int64]bool, error) {
	res, err := q.QueryContext(ctx, query, args...)
	if err != nil {
		return nil, err
	}
	defer res.Close()
	out := map[int64]bool{}
	for res.Next() {
		var id int64
		if err := res.Scan(&id); err != nil {
			return nil, err
		}
		out[id] = true
	}
	return out, res.Err()
}

func (c *conformance) sqlDB(t *testing.T) *sql.DB {
	t.Helper()
	db, err := c.db.DB()
	if err != nil {
		t.Fatal(err)
	}
	return db
}

// sql names the check's tables in query ({records}, {sequences}) and binds
// its ? placeholders for the engine.
func (c *conformance) sql(query string) string {
	return c.d.Bind(strings.NewReplacer("{records}", c.tb.Records, "{sequences}", c.tb.Sequences).Replace(query))
}

// exec runs a statement on the pool and returns how many rows it changed.
func (c *conformance) exec(t *testing.T, query string, args ...any) int64 {
	t.Helper()
	res, err := c.pool().ExecContext(ctx, query, args...)
	if err != nil {
		t.Fatalf("%v\n%s", err, query)
	}
	n, err := res.RowsAffected()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// ClaimTx runs fn in the dialect's claim transaction and fails t if it fails.
func (c *conformance) claimTx(t *testing.T, fn func(q dialect.Querier) error) {
	t.Helper()
	if err := c.d.ClaimTx(ctx, c.db, fn); err != nil {
		t.Fatal(err)
	}
}

// event returns a new event of aggregate k.
func (c *conformance) event(k dialect.Aggregate) dialect.Record {
	c.n++
	id := fmt.Sprintf("ev-%d", c.n)
	return dialect.Record{ID: id, Type: "t", AggregateType: k.Type, AggregateID: k.ID, Key: id,
		Payload: fmt.Sprintf(`{"n":%d}`, c.n), OccurredAt: c.ago(time.Hour).Add(time.Duration(c.n) * time.Microsecond)}
}

// insert stores e through InsertEvent, with now as its time, in a
// transaction of its own that commits unless InsertEvent fails.
func (c *conformance) insert(t *testing.T, e dialect.Record, notify bool) (bool, error) {
	t.Helper()
	tx, err := c.sqlDB(t).BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	ok, err := c.d.InsertEvent(ctx, tx, c.tb, &e, c.now, notify)
	if err != nil {
		_ = tx.Rollback()
		return ok, err
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	return ok, nil
}

// spec is the delivery state a check puts a row in. Its zero value is a
// pending row that came due a minute before now; a zero time or an empty
// text is NULL.
type spec struct {
	state                string
	next, locked         time.Time
	batch, lastErr, kind string
	attempts, revivals   int
	updated, delivered   time.Time
}

func dueAt(at time.Time) spec   { return spec{next: at} }
func retryAt(at time.Time) spec { return spec{state: StateRetry, next: at} }
func leasedUntil(at time.Time, batch string) spec {
	return spec{state: StateDelivering, next: at, locked: at, batch: batch}
}
func failedAt(at time.Time, kind string, revivals int) spec {
	return spec{state: StateFailed, updated: at, kind: kind, revivals: revivals, lastErr: "failed"}
}
func deliveredAt(at time.Time) spec { return spec{state: StateDelivered, delivered: at} }

// put writes the next event of aggregate ("agg", agg) and puts its row in
// state s; it returns the row's id.
func (c *conformance) put(t *testing.T, agg string, s spec) int64 {
	t.Helper()
	return c.putEvent(t, c.event(dialect.Aggregate{Type: "agg", ID: agg}), s)
}

func (c *conformance) putEvent(t *testing.T, e dialect.Record, s spec) int64 {
	t.Helper()
	if ok, err := c.insert(t, e, false); !ok || err != nil {
		t.Fatalf("insertEvent = %v, %v", ok, err)
	}
	id := c.idOf(t, e.ID)
	c.set(t, id, s)
	return id
}

// idOf returns the id of the row of event eventID.
func (c *conformance) idOf(t *testing.T, eventID string) int64 {
	t.Helper()
	var id int64
	if err := c.pool().QueryRowContext(ctx, c.sql(`SELECT id FROM {records} WHERE event_id = ?`), eventID).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return id
}

// set puts row id in state s.
func (c *conformance) set(t *testing.T, id int64, s spec) {
	t.Helper()
	if s.state == "" {
		s.state = StatePending
	}
	if s.next.IsZero() {
		s.next = c.ago(time.Minute)
	}
	if s.updated.IsZero() {
		s.updated = c.ago(time.Minute)
	}
	c.exec(t, c.sql(`UPDATE {records} SET delivery_state = ?, next_attempt_at = ?, locked_until = ?, batch_id = ?,
	delivery_attempts = ?, last_error = ?, failure_kind = ?, revivals = ?, updated_at = ?, delivered_at = ? WHERE id = ?`),
		s.state, c.ts(s.next), c.orNull(s.locked), textOrNull(s.batch), s.attempts, textOrNull(s.lastErr),
		textOrNull(s.kind), s.revivals, c.ts(s.updated), c.orNull(s.delivered), id)
}

func (c *conformance) orNull(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return c.ts(t)
}

func textOrNull(s string) any {
	if s == "" {
		return nil
	}
	return s
}

// stored is a row as a check reads it back; a NULL time is zero.
type stored struct {
	state, eventID, key, payload     string
	headers, batch, lastErr, kind    sql.NullString
	seq                              int64
	attempts, revivals               int
	next, locked, updated, delivered time.Time
	occurred, created                time.Time
}

func (c *conformance) get(t *testing.T, id int64) stored {
	t.Helper()
	var (
		s                                                   stored
		next, locked, updated, delivered, occurred, created dialect.Time
	)
	rt := c.d.ReadTime
	err := c.pool().QueryRowContext(ctx, c.sql(`SELECT delivery_state, event_id, idempotency_key, payload, headers,
	batch_id, last_error, failure_kind, aggregate_sequence, delivery_attempts, revivals, `+
		rt("next_attempt_at")+`, `+rt("locked_until")+`, `+rt("updated_at")+`, `+rt("delivered_at")+`, `+
		rt("occurred_at")+`, `+rt("created_at")+` FROM {records} WHERE id = ?`), id).Scan(
		&s.state, &s.eventID, &s.key, &s.payload, &s.headers, &s.batch, &s.lastErr, &s.kind, &s.seq, &s.attempts,
		&s.revivals, &next, &locked, &updated, &delivered, &occurred, &created)
	if err != nil {
		t.Fatalf("read row %d: %v", id, err)
	}
	s.next, s.locked, s.updated, s.delivered = next.Time, locked.Time, updated.Time, delivered.Time
	s.occurred, s.created = occurred.Time, created.Time
	return s
}

// count runs a count(*) query.
func (c *conformance) count(t *testing.T, query string, args ...any) int {
	t.Helper()
	var n int
	if err := c.pool().QueryRowContext(ctx, query, args...).Scan(&n); err != nil {
		t.Fatalf("%v\n%s", err, query)
	}
	return n
}

// drain reads every row of a statement that returns rows: on SQLite, an
// UPDATE ... RETURNING changes nothing until its first row is read.
func drain(res *sql.Rows, err error) error {
	if err != nil {
		return err
	}
	defer res.Close()
	for res.Next() {
	}
	return res.Err()
}

// probe creates a small table of the check's own, conformance_probe, with
// rows 1 and 2.
func (c *conformance) probe(t *testing.T) {
	t.Helper()
	c.exec(t, `CREATE TABLE conformance_probe (id INTEGER PRIMARY KEY, n INTEGER NOT NULL)`)
	c.exec(t, `INSERT INTO conformance_probe (id, n) VALUES (1, 0), (2, 0)`)
}

// whileClaimHolds runs hold in a claim transaction and, while that
// transaction is still open, other on another goroutine. It reports
// whether other returned before the claim transaction ended, waiting up to
// patience for that; other's error fails t.
func (c *conformance) whileClaimHolds(t *testing.T, hold func(q dialect.Querier) error, other func() error, patience time.Duration) bool {
	t.Helper()
	held, release, done := make(chan struct{}), make(chan struct{}), make(chan struct{})
	var once sync.Once
	claimed := make(chan error, 1)
	go func() {
		claimed <- c.d.ClaimTx(ctx, c.db, func(q dialect.Querier) error {
			if err := hold(q); err != nil {
				return err
			}
			once.Do(func() { close(held) })
			<-release
			return nil
		})
	}()
	select {
	case <-held:
	case err := <-claimed:
		t.Fatalf("the holding claim ended before it held: %v", err)
	}
	var otherErr error
	go func() { defer close(done); otherErr = other() }()
	overlapped := false
	select {
	case <-done:
		overlapped = true
	case <-time.After(patience):
	}
	close(release)
	if err := <-claimed; err != nil {
		t.Fatalf("holding claim: %v", err)
	}
	<-done
	if otherErr != nil {
		t.Fatal(otherErr)
	}
	return overlapped
}

// patience is how long whileClaimHolds waits for what runs beside a claim:
// where claims lock rows it must not wait at all (a generous bound, for a
// loaded machine); where a claim holds the database it must wait (a short
// look suffices).
func (c *conformance) patience() time.Duration {
	if c.rowLocks() {
		return 10 * time.Second
	}
	return 300 * time.Millisecond
}

func ids(rows []windowRow) []int64 {
	out := make([]int64, len(rows))
	for i, r := range rows {
		out[i] = r.id
	}
	return out
}

func sortedIDs(set map[int64]bool) []int64 { return slices.Sorted(maps.Keys(set)) }

func sameJSON(a, b string) bool {
	var x, y any
	return json.Unmarshal([]byte(a), &x) == nil && json.Unmarshal([]byte(b), &y) == nil && reflect.DeepEqual(x, y)
}

// awkward is text that a list or a statement must carry byte for byte:
// quotes, backslashes, control characters, JSON's special characters,
// text that looks like JSON, and 255 characters of four bytes each (the
// longest identifier an event may have).
var awkward = []string{
	`it's "quoted"`, `back\slash`, "tab\tnew\nline", `<&>`, "ünïcödé 😀", "\u2028\u2029",
	`%_*`, `[1,"2"]`, "null", strings.Repeat("😀", 255), strings.Repeat("x", 255),
}

// lookalikes differ from an awkward text only in case, a trailing space or
// one character fewer: none of them may match it.
var lookalikes = []string{`IT'S "QUOTED"`, `it's "quoted" `, "ÜNÏCÖDÉ 😀", strings.Repeat("😀", 254), strings.Repeat("x", 254)}

func checkName(t *testing.T, c *conformance) {
	want := map[outboxtest.Engine]string{outboxtest.SQLite: "sqlite", outboxtest.Postgres: "postgres", outboxtest.MySQL: "mysql"}[c.e]
	if got := c.d.Name(); got != want {
		t.Fatalf("name() = %q, want %q", got, want)
	}
	if ms, err := migrationsFor(c.d.Name()); err != nil || len(ms) == 0 {
		t.Fatalf("migrations of %q: %d, %v; want the engine's migrations", c.d.Name(), len(ms), err)
	}
}

// The quoted names reach the tables AutoMigrate made for a name that is a
// reserved word in mixed case.
func checkTables(t *testing.T, c *conformance) {
	if c.tb.Name != conformanceTable || c.tb.Records != c.tb.Quote(conformanceTable) || c.tb.Sequences != c.tb.Quote(conformanceTable+"_sequences") {
		t.Fatalf("tables(%q) = %+v", conformanceTable, c.tb)
	}
	c.put(t, "A", spec{})
	c.put(t, "A", spec{})
	if n := c.count(t, c.sql(`SELECT count(*) FROM {records}`)); n != 2 {
		t.Fatalf("%d rows in %s, want 2", n, c.tb.Records)
	}
	if n := c.count(t, c.sql(`SELECT last_sequence FROM {sequences} WHERE aggregate_id = ?`), "A"); n != 2 {
		t.Fatalf("last sequence %d in %s, want 2", n, c.tb.Sequences)
	}
}

// bind numbers ? placeholders in order.
func checkBind(t *testing.T, c *conformance) {
	c.put(t, "A", spec{})
	a2 := c.put(t, "A", spec{})
	c.put(t, "B", spec{})
	var id int64
	err := c.pool().QueryRowContext(ctx, c.d.Bind(`SELECT id FROM `+c.tb.Records+` WHERE aggregate_id = ? AND aggregate_sequence = ?`), "A", 2).Scan(&id)
	if err != nil || id != a2 {
		t.Fatalf("row of A #2 = %d, %v; want %d", id, err, a2)
	}
}

// A time stored through TimeArg reads back to the microsecond, never
// later than given, and compares correctly with times given in any zone.
func checkTimeArg(t *testing.T, c *conformance) {
	given := time.Date(2031, 2, 28, 3, 4, 5, 123456789, time.FixedZone("+05:30", 5*3600+1800))
	west := time.FixedZone("-08:00", -8*3600)
	r1 := c.put(t, "A", spec{next: given})
	r2 := c.put(t, "B", spec{next: given.Add(time.Microsecond).In(west)}) // its wall clock is a day earlier
	got := c.get(t, r1).next
	if !got.Truncate(time.Microsecond).Equal(given.Truncate(time.Microsecond)) || got.After(given) {
		t.Fatalf("stored %v, read back %v: want it to the microsecond, and not later", given, got)
	}
	for _, tc := range []struct {
		op   string
		arg  time.Time
		want int
	}{
		{"=", given.UTC(), 1},
		{"=", given.In(west), 1},
		{"<=", given.In(west), 1},
		{"<=", given.Add(-time.Microsecond), 0},
		{"<", given.Add(time.Microsecond), 1},
		{">", given.Add(-time.Microsecond).UTC(), 1},
	} {
		if n := c.count(t, c.sql(`SELECT count(*) FROM {records} WHERE id = ? AND next_attempt_at `+tc.op+` ?`), r1, c.ts(tc.arg)); n != tc.want {
			t.Errorf("stored %v %s %v: %d rows, want %d", given, tc.op, tc.arg, n, tc.want)
		}
	}
	res, err := c.pool().QueryContext(ctx, c.sql(`SELECT id FROM {records} ORDER BY next_attempt_at`))
	if err != nil {
		t.Fatal(err)
	}
	defer res.Close()
	var order []int64
	for res.Next() {
		var id int64
		if err := res.Scan(&id); err != nil {
			t.Fatal(err)
		}
		order = append(order, id)
	}
	if !slices.Equal(order, []int64{r1, r2}) {
		t.Fatalf("time order %v, want %v: the later instant has the earlier wall clock", order, []int64{r1, r2})
	}
}

// ReadTime makes a value the driver cannot read as a time fail to scan,
// rather than read as the zero time. Each engine accepts some of these
// values by hand; none may read.
func checkReadTime(t *testing.T, c *conformance) {
	id := c.put(t, "A", spec{})
	accepted := 0
	for _, v := range []string{"garbage", "infinity", "0000-00-00 00:00:00"} {
		if _, err := c.pool().ExecContext(ctx, c.sql(`UPDATE {records} SET occurred_at = ? WHERE id = ?`), v, id); err != nil {
			continue // the column cannot hold it
		}
		accepted++
		var at dialect.Time
		err := c.pool().QueryRowContext(ctx, c.sql(`SELECT `+c.d.ReadTime("occurred_at")+` FROM {records} WHERE id = ?`), id).Scan(&at)
		if err == nil {
			t.Errorf("occurred_at %q read as %v, want a scan error", v, at.Time)
		}
	}
	t.Logf("%d of the unreadable values stored", accepted)
}

// ReturnsRows is true exactly for the kinds of statement that take
// RETURNING on the engine.
func checkReturnsRows(t *testing.T, c *conformance) {
	c.probe(t)
	for _, tc := range []struct {
		op   Op
		stmt string
		id   int64
	}{
		{OpCreate, `INSERT INTO conformance_probe (id, n) VALUES (3, 0) RETURNING id`, 3},
		{OpUpdate, `UPDATE conformance_probe SET n = 1 WHERE id = 1 RETURNING id`, 1},
		{OpDelete, `DELETE FROM conformance_probe WHERE id = 2 RETURNING id`, 2},
	} {
		got, err := queryIDs(ctx, c.pool(), tc.stmt)
		switch {
		case c.d.ReturnsRows(tc.op == OpUpdate) && (err != nil || !slices.Equal(sortedIDs(got), []int64{tc.id})):
			t.Errorf("returnsRows(%s) is true, but %s returned %v, %v", tc.op, tc.stmt, sortedIDs(got), err)
		case !c.d.ReturnsRows(tc.op == OpUpdate) && err == nil:
			t.Errorf("returnsRows(%s) is false, but the engine ran %s", tc.op, tc.stmt)
		}
	}
}

// InsertedColumn tells an upsert's inserted rows from its updated ones;
// where it is empty, the plugin reads the existing keys instead, and
// KeyReads' uniqueKeys, where set, names every unique key of a table.
func checkInsertedColumn(t *testing.T, c *conformance) {
	c.probe(t)
	col := c.d.InsertedColumn()
	if col == "" {
		kr := c.d.KeyReads()
		if kr.UniqueKeys == nil {
			return
		}
		c.exec(t, `CREATE UNIQUE INDEX conformance_probe_n ON conformance_probe (n, id)`)
		keys, err := kr.UniqueKeys(ctx, c.pool(), "conformance_probe")
		if err != nil {
			t.Fatal(err)
		}
		if len(keys) != 2 || !slices.Equal(keys["conformance_probe_n"], []string{"id", "n"}) {
			t.Fatalf("unique keys %v, want the primary key and conformance_probe_n (id, n)", keys)
		}
		return
	}
	// PostgreSQL's upsert: the only engine with such a column.
	res, err := c.pool().QueryContext(ctx, `INSERT INTO conformance_probe (id, n) VALUES (1, 10), (3, 30)
ON CONFLICT (id) DO UPDATE SET n = excluded.n RETURNING id, `+col)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Close()
	got := map[int64]bool{}
	for res.Next() {
		var (
			id       int64
			inserted bool
		)
		if err := res.Scan(&id, &inserted); err != nil {
			t.Fatal(err)
		}
		got[id] = inserted
	}
	if want := map[int64]bool{1: false, 3: true}; !maps.Equal(got, want) {
		t.Fatalf("inserted per id %v, want %v", got, want)
	}
}

// ErrorAbortsTx is true exactly where a failed statement leaves its
// transaction unable to do or commit anything.
func checkErrorAbortsTx(t *testing.T, c *conformance) {
	c.probe(t)
	tx, err := c.sqlDB(t).BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	if _, err := tx.ExecContext(ctx, `INSERT INTO conformance_probe (id, n) VALUES (3, 0)`); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.ExecContext(ctx, `INSERT INTO conformance_probe (id, n) VALUES (1, 0)`); err == nil {
		t.Fatal("a duplicate key did not fail")
	}
	_, later := tx.ExecContext(ctx, `INSERT INTO conformance_probe (id, n) VALUES (4, 0)`)
	commit := tx.Commit()
	n := c.count(t, `SELECT count(*) FROM conformance_probe`)
	aborted := later != nil && n == 2
	kept := later == nil && commit == nil && n == 4
	if c.d.ErrorAbortsTx() && !aborted || !c.d.ErrorAbortsTx() && !kept {
		t.Fatalf("errorAbortsTx() = %v, but after a failed statement: the next one %v, the commit %v, %d rows in the table (2 before)",
			c.d.ErrorAbortsTx(), later, commit, n)
	}
}

// IDList carries ids, none or any, through the engine: in a claim's
// transaction (the lease, where the claim is not one statement) and on
// the pool (the settle).
func checkIDList(t *testing.T, c *conformance) {
	r1, r2, r3 := c.put(t, "A", spec{}), c.put(t, "B", spec{}), c.put(t, "C", spec{})
	lease := func(list []int64) map[int64]bool {
		var got map[int64]bool
		c.claimTx(t, func(q dialect.Querier) error {
			res, err := q.QueryContext(ctx, c.st.Lease, "b1", c.ts(c.in(time.Minute)), c.ts(c.now), c.d.IDList(list))
			if err != nil {
				return err
			}
			defer res.Close()
			rows, err := scanLeased(res, len(list))
			got = map[int64]bool{}
			for _, r := range rows {
				got[r.id] = true
			}
			return err
		})
		return got
	}
	if c.st.Lease == "" {
		// The claim takes no list; the settles below carry one.
		c.exec(t, c.sql(`UPDATE {records} SET delivery_state = 'delivering', batch_id = 'b1' WHERE id IN (?, ?)`), r1, r3)
	} else {
		for _, list := range [][]int64{nil, {}, {-1, 1 << 62}} {
			if got := lease(list); len(got) != 0 {
				t.Errorf("lease of %v leased %v", list, sortedIDs(got))
			}
		}
		if got := lease([]int64{r3, 1 << 62, r1}); !slices.Equal(sortedIDs(got), []int64{r1, r3}) {
			t.Fatalf("lease leased %v, want %v", sortedIDs(got), []int64{r1, r3})
		}
	}
	if n := c.exec(t, c.st.SettleDelivered, c.ts(c.now), "b1", c.d.IDList(nil)); n != 0 {
		t.Errorf("settle of no ids settled %d rows", n)
	}
	if n := c.exec(t, c.st.SettleDelivered, c.ts(c.now), "b1", c.d.IDList([]int64{r1, r2})); n != 1 {
		t.Errorf("settle of %d (leased) and %d (not) settled %d rows, want 1", r1, r2, n)
	}
}

// TextList carries text byte for byte, and NULL for a nil list: through
// the requeue, whose lists select event ids and types.
func checkTextList(t *testing.T, c *conformance) {
	var failed []int64
	for i, s := range awkward {
		e := c.event(dialect.Aggregate{Type: "agg", ID: fmt.Sprint(i)})
		e.ID, e.Key, e.Type = s, s, s
		failed = append(failed, c.putEvent(t, e, failedAt(c.ago(time.Hour), failureExhausted, 0)))
	}
	plain := c.put(t, "plain", failedAt(c.ago(time.Hour), failureExhausted, 0))
	all := append(slices.Clone(failed), plain)
	requeue := func(ids, types []string) []int64 {
		for _, id := range all {
			c.set(t, id, failedAt(c.ago(time.Hour), failureExhausted, 0))
		}
		c.claimTx(t, func(q dialect.Querier) error {
			return drain(q.QueryContext(ctx, c.st.Requeue, c.ts(c.now), 100, nil, c.d.TextList(ids), c.d.TextList(types)))
		})
		var moved []int64
		for _, id := range all {
			if c.get(t, id).state == StatePending {
				moved = append(moved, id)
			}
		}
		return moved
	}
	for _, tc := range []struct {
		name       string
		ids, types []string
		want       []int64
	}{
		{"NilIsNull", nil, nil, all},
		{"EmptySelectsNone", []string{}, nil, nil},
		{"AwkwardIDs", awkward, nil, failed},
		{"AwkwardTypes", nil, awkward, failed},
		{"OneAwkwardID", []string{awkward[9]}, nil, failed[9:10]},
		{"Lookalikes", lookalikes, nil, nil},
	} {
		if got := requeue(tc.ids, tc.types); !slices.Equal(got, tc.want) {
			t.Errorf("%s: requeue moved rows %v, want %v", tc.name, got, tc.want)
		}
	}
}

// EventList carries aggregates and sequences, in order, byte for byte:
// through the order check (a claim's transaction, where the claim is not
// one statement) and the unpark (the pool).
func checkEventList(t *testing.T, c *conformance) {
	var aggs []dialect.Aggregate
	for i := 0; i+1 < len(awkward); i += 2 {
		aggs = append(aggs, dialect.Aggregate{Type: awkward[i], ID: awkward[i+1]})
	}
	aggs = append(aggs, dialect.Aggregate{Type: awkward[len(awkward)-1], ID: awkward[0]})
	var second []int64
	for _, k := range aggs {
		c.putEvent(t, c.event(k), leasedUntil(c.in(time.Hour), "live"))
		second = append(second, c.putEvent(t, c.event(k), dueAt(c.in(time.Hour))))
	}
	var ask []dialect.Position
	var want []string
	for _, k := range aggs {
		ask = append(ask, dialect.Position{Aggregate: k, Seq: 1})
		want = append(want, "flight")
	}
	for _, s := range lookalikes {
		ask = append(ask, dialect.Position{Aggregate: dialect.Aggregate{Type: s, ID: aggs[0].ID}, Seq: 1}, dialect.Position{Aggregate: dialect.Aggregate{Type: aggs[0].Type, ID: s}, Seq: 1})
		want = append(want, "", "")
	}
	ask = append(ask, ask[0])
	want = append(want, "flight")
	c.claimTx(t, func(q dialect.Querier) error {
		if c.st.Undelivered == "" {
			return nil
		}
		got, err := queryStates(ctx, q, len(ask), c.st.Undelivered, append([]any{c.ts(c.now)}, c.d.EventList(ask)...)...)
		if err != nil {
			return err
		}
		for i, st := range got {
			if st.String != want[i] {
				t.Errorf("order check of %q #%d: %q, want %q", ask[i].Aggregate, ask[i].Seq, st.String, want[i])
			}
		}
		if _, err := queryStates(ctx, q, 0, c.st.Undelivered, append([]any{c.ts(c.now)}, c.d.EventList(nil)...)...); err != nil {
			t.Errorf("order check of an empty list: %v", err)
		}
		return nil
	})
	if n := c.exec(t, c.st.Unpark, append([]any{c.ts(c.now)}, c.d.EventList(nil)...)...); n != 0 {
		t.Errorf("unpark of no aggregates moved %d rows", n)
	}
	if n := c.exec(t, c.st.Unpark, append([]any{c.ts(c.now)}, c.d.EventList(ask[:len(aggs)])...)...); n != int64(len(aggs)) {
		t.Errorf("unpark moved %d rows, want %d", n, len(aggs))
	}
	for _, id := range second {
		if got := c.get(t, id).next; !got.Equal(c.now) {
			t.Errorf("row %d after unpark: next attempt %v, want now", id, got)
		}
	}
}

func checkClaimTx(t *testing.T, c *conformance) {
	t.Run("CommitsWhatItDid", func(t *testing.T) {
		id := c.put(t, "commit", spec{})
		c.claimTx(t, func(q dialect.Querier) error { return c.markDelivering(q, id) })
		if s := c.get(t, id); s.state != StateDelivering || s.batch.String != "b1" {
			t.Fatalf("row after the claim: %s, batch %v; want delivering, b1", s.state, s.batch)
		}
	})
	t.Run("AnErrorRollsBack", func(t *testing.T) {
		id := c.put(t, "rollback", spec{})
		stop := errors.New("stop")
		err := c.d.ClaimTx(ctx, c.db, func(q dialect.Querier) error {
			if err := c.markDelivering(q, id); err != nil {
				return err
			}
			if delivering, err := queryIDs(ctx, q, c.sql(`SELECT id FROM {records} WHERE id = ? AND delivery_state = 'delivering'`), id); err != nil || !delivering[id] {
				return fmt.Errorf("the lease did nothing: %v", err)
			}
			return stop
		})
		if !errors.Is(err, stop) {
			t.Fatalf("claimTx = %v, want fn's error", err)
		}
		if s := c.get(t, id); s.state != StatePending || s.batch.Valid {
			t.Fatalf("row after a failed claim: %s, batch %v; want it as it was", s.state, s.batch)
		}
	})
	t.Run("HoldsWhatItLockedUntilItEnds", func(t *testing.T) {
		c.exec(t, c.sql(`DELETE FROM {records}`))
		a, b := c.put(t, "A", dueAt(c.ago(2*time.Minute))), c.put(t, "B", spec{})
		var beside []windowRow
		overlapped := c.whileClaimHolds(t, func(q dialect.Querier) error {
			_, err := c.lockOldest(q, 1)
			return err
		}, func() error {
			return c.d.ClaimTx(ctx, c.db, func(q dialect.Querier) error {
				var err error
				beside, err = c.lockOldest(q, 10)
				return err
			})
		}, c.patience())
		switch {
		case c.rowLocks() && (!overlapped || !slices.Equal(ids(beside), []int64{b})):
			t.Fatalf("a claim beside one holding %d: finished %v, read %v; want at once, %v", a, overlapped, ids(beside), []int64{b})
		case !c.rowLocks() && (overlapped || !slices.Equal(ids(beside), []int64{a, b})):
			t.Fatalf("a claim beside one holding the database: finished %v, read %v; want after it, %v", overlapped, ids(beside), []int64{a, b})
		}
	})
	t.Run("RunsAgainAfterALockConflict", func(t *testing.T) {
		lockErr := lockWaitError(t, c)
		runs := 0
		err := c.d.ClaimTx(ctx, c.db, func(dialect.Querier) error {
			if runs++; runs == 1 {
				return lockErr
			}
			return nil
		})
		if c.d.LockConflict(lockErr) && (err != nil || runs != 2) || !c.d.LockConflict(lockErr) && (!errors.Is(err, lockErr) || runs != 1) {
			t.Fatalf("claimTx after fn failed once with %v (lockConflict %v): %d runs, %v",
				lockErr, c.d.LockConflict(lockErr), runs, err)
		}
	})
	t.Run("SeesWhatCommitsDuringIt", func(t *testing.T) {
		if !c.rowLocks() {
			t.Skip("nothing commits while a claim transaction holds the database")
		}
		// A single connection whose sessions default to REPEATABLE READ,
		// under which a second read would repeat the first.
		other := outboxtest.Reopen(t, c.info, nil)
		otherDB, err := other.DB()
		if err != nil {
			t.Fatal(err)
		}
		otherDB.SetMaxOpenConns(1)
		repeatable := map[outboxtest.Engine]string{
			outboxtest.Postgres: `SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL REPEATABLE READ`,
			outboxtest.MySQL:    `SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ`,
		}[c.e]
		if _, err := otherDB.ExecContext(ctx, repeatable); err != nil {
			t.Fatal(err)
		}
		// Plain reads: a locking read sees the latest rows at any level.
		var before, after map[int64]bool
		read := c.sql(`SELECT id FROM {records}`)
		err = c.d.ClaimTx(ctx, other, func(q dialect.Querier) error {
			var err error
			if before, err = queryIDs(ctx, q, read); err != nil {
				return err
			}
			c.put(t, "committed meanwhile", spec{})
			after, err = queryIDs(ctx, q, read)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		if len(after) != len(before)+1 {
			t.Fatalf("rows %v, then %v after a commit: want the committed row seen", sortedIDs(before), sortedIDs(after))
		}
	})
}

// MigrateTx holds a lock that another migration of the table waits for;
// where DDL is transactional, fn's error rolls its work back.
func checkMigrateTx(t *testing.T, c *conformance) {
	held, release, entered := make(chan struct{}), make(chan struct{}), make(chan struct{})
	first := make(chan error, 1)
	go func() {
		first <- c.d.MigrateTx(ctx, c.db, c.tb, func(dialect.Querier) error {
			close(held)
			<-release
			return nil
		})
	}()
	select {
	case <-held:
	case err := <-first:
		t.Fatalf("migrateTx: %v", err)
	}
	second := make(chan error, 1)
	go func() {
		second <- c.d.MigrateTx(ctx, c.db, c.tb, func(dialect.Querier) error {
			close(entered)
			return nil
		})
	}()
	select {
	case <-entered:
		t.Error("a second migration ran while the first held its lock")
	case <-time.After(300 * time.Millisecond):
	}
	close(release)
	if err := errors.Join(<-first, <-second); err != nil {
		t.Fatal(err)
	}

	stop := errors.New("stop")
	err := c.d.MigrateTx(ctx, c.db, c.tb, func(q dialect.Querier) error {
		if _, err := q.ExecContext(ctx, `CREATE TABLE conformance_migrated (id INTEGER PRIMARY KEY)`); err != nil {
			return err
		}
		return stop
	})
	if !errors.Is(err, stop) {
		t.Fatalf("migrateTx = %v, want fn's error", err)
	}
	_, kept := c.pool().ExecContext(ctx, `SELECT count(*) FROM conformance_migrated`)
	// MySQL commits each DDL statement on its own.
	if transactional := c.e != outboxtest.MySQL; transactional == (kept == nil) {
		t.Fatalf("the table a failed migration created: %v (transactional DDL %v)", kept, transactional)
	}
}

// listen wakes for every notification, the one InsertEvent asks for at
// commit included, until its context ends; elsewhere it says ErrNoListen.
func checkListen(t *testing.T, c *conformance) {
	wakes := make(chan struct{}, 16)
	lctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.d.Listen(lctx, c.db, c.tb, func() { wakes <- struct{}{} }) }()
	waitWake := func(what string) {
		t.Helper()
		select {
		case <-wakes:
		case err := <-done:
			t.Fatalf("listen returned before %s: %v", what, err)
		case <-time.After(10 * time.Second):
			t.Fatalf("no wake-up for %s within 10s", what)
		}
	}
	noWake := func(what string) {
		t.Helper()
		select {
		case <-wakes:
			t.Fatalf("a wake-up for %s", what)
		case <-time.After(200 * time.Millisecond):
		}
	}
	if _, notifies := c.d.(dialect.Notifier); !notifies {
		select {
		case err := <-done:
			if !errors.Is(err, dialect.ErrNoListen) {
				t.Fatalf("listen = %v, want errNoListen", err)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("listen did not return")
		}
		if ok, err := c.insert(t, c.event(dialect.Aggregate{Type: "agg", ID: "A"}), true); !ok || err != nil {
			t.Fatalf("insertEvent with notify = %v, %v", ok, err)
		}
		noWake("a notification the engine has not")
		return
	}
	waitWake("the start (rows may have committed before)")
	tx, err := c.sqlDB(t).BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback()
	e := c.event(dialect.Aggregate{Type: "agg", ID: "A"})
	if ok, err := c.d.InsertEvent(ctx, tx, c.tb, &e, c.now, true); !ok || err != nil {
		t.Fatalf("insertEvent = %v, %v", ok, err)
	}
	noWake("an insert not committed yet")
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	waitWake("a committed insert with notify")
	if _, err := c.insert(t, c.event(dialect.Aggregate{Type: "agg", ID: "A"}), false); err != nil {
		t.Fatal(err)
	}
	noWake("an insert without notify")
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("listen did not return when its context ended")
	}
}

// plainPool is a connection pool that can neither begin a transaction nor
// say which *sql.DB it is.
type plainPool struct{ db *sql.DB }

func (p plainPool) PrepareContext(ctx context.Context, q string) (*sql.Stmt, error) {
	return p.db.PrepareContext(ctx, q)
}
func (p plainPool) ExecContext(ctx context.Context, q string, args ...any) (sql.Result, error) {
	return p.db.ExecContext(ctx, q, args...)
}
func (p plainPool) QueryContext(ctx context.Context, q string, args ...any) (*sql.Rows, error) {
	return p.db.QueryContext(ctx, q, args...)
}
func (p plainPool) QueryRowContext(ctx context.Context, q string, args ...any) *sql.Row {
	return p.db.QueryRowContext(ctx, q, args...)
}

// CheckPool accepts the pool a claim transaction can begin on, and
// refuses, with a reason, one it cannot.
func checkCheckPool(t *testing.T, c *conformance) {
	noop := func(dialect.Querier) error { return nil }
	if err := c.d.CheckPool(c.db); err != nil {
		t.Fatalf("checkPool of the default pool: %v", err)
	}
	if err := c.d.ClaimTx(ctx, c.db, noop); err != nil {
		t.Fatalf("claimTx on the default pool: %v", err)
	}
	plain := c.db.WithContext(ctx) // a Statement of its own
	plain.Statement.ConnPool = plainPool{c.sqlDB(t)}
	if err := c.d.CheckPool(plain); err == nil || err.Error() == "" {
		t.Fatalf("checkPool of a pool that cannot begin a transaction = %v, want a reason", err)
	}
	if err := c.d.ClaimTx(ctx, plain, noop); err == nil {
		t.Fatal("claimTx ran on a pool that checkPool refused")
	}
}

// shortLockWait makes a session give up on a lock at once.
var shortLockWait = map[outboxtest.Engine]string{
	outboxtest.SQLite:   `PRAGMA busy_timeout = 0`,
	outboxtest.Postgres: `SET lock_timeout = '50ms'`,
	outboxtest.MySQL:    `SET SESSION innodb_lock_wait_timeout = 1`,
}

// lockWaitError returns the engine's own error for a transaction that
// gave up waiting for a lock another one holds: a lock wait timeout, or
// SQLITE_BUSY.
func lockWaitError(t *testing.T, c *conformance) error {
	t.Helper()
	c.exec(t, `CREATE TABLE IF NOT EXISTS conformance_locks (id INTEGER PRIMARY KEY)`)
	holder, err := c.sqlDB(t).BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer holder.Rollback()
	if _, err := holder.ExecContext(ctx, `INSERT INTO conformance_locks (id) VALUES (1)`); err != nil {
		t.Fatal(err)
	}
	other, err := outboxtest.Reopen(t, c.info, nil).DB()
	if err != nil {
		t.Fatal(err)
	}
	conn, err := other.Conn(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, shortLockWait[c.e]); err != nil {
		t.Fatal(err)
	}
	tx, err := conn.BeginTx(ctx, nil)
	if err == nil {
		_, err = tx.ExecContext(ctx, `INSERT INTO conformance_locks (id) VALUES (1)`)
		_ = tx.Rollback()
	}
	if err == nil {
		t.Fatal("no error for a lock another transaction holds")
	}
	return err
}

// deadlockError returns the engine's own error for the victim of a
// deadlock: two transactions that each wait for a row the other locked.
func deadlockError(t *testing.T, c *conformance) error {
	t.Helper()
	c.probe(t)
	db := c.sqlDB(t)
	var firsts sync.WaitGroup
	firsts.Add(2)
	cross := func(a, b int) error {
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			firsts.Done()
			return err
		}
		defer tx.Rollback()
		_, err = tx.ExecContext(ctx, c.d.Bind(`UPDATE conformance_probe SET n = n + 1 WHERE id = ?`), a)
		firsts.Done()
		if err != nil {
			return err
		}
		firsts.Wait()
		if _, err := tx.ExecContext(ctx, c.d.Bind(`UPDATE conformance_probe SET n = n + 1 WHERE id = ?`), b); err != nil {
			return err
		}
		return tx.Commit()
	}
	errs := make(chan error, 2)
	go func() { errs <- cross(1, 2) }()
	go func() { errs <- cross(2, 1) }()
	e1, e2 := <-errs, <-errs
	if (e1 == nil) == (e2 == nil) {
		t.Fatalf("crossed transactions: %v and %v; want one deadlock victim", e1, e2)
	}
	return errors.Join(e1, e2)
}

// LockConflict reports the engine's real deadlocks and lock wait timeouts
// on MySQL, where the dispatcher runs again what they ended, and nothing
// elsewhere; it never reports an unrelated error.
func checkLockConflict(t *testing.T, c *conformance) {
	want := c.e == outboxtest.MySQL
	conflicts := map[string]error{"lock wait": lockWaitError(t, c)}
	if c.rowLocks() {
		conflicts["deadlock"] = deadlockError(t, c)
	}
	for what, err := range conflicts {
		if got := c.d.LockConflict(err); got != want {
			t.Errorf("lockConflict(%s: %v) = %v, want %v", what, err, got, want)
		}
		if got := c.d.LockConflict(fmt.Errorf("claim: %w", err)); got != want {
			t.Errorf("lockConflict of a wrapped %s = %v, want %v", what, got, want)
		}
	}
	_, duplicate := c.pool().ExecContext(ctx, `INSERT INTO conformance_locks (id) VALUES (2), (2)`)
	_, missing := c.pool().ExecContext(ctx, `SELECT * FROM conformance_missing`)
	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, ended := c.pool().ExecContext(cancelled, `SELECT 1`)
	for _, err := range []error{duplicate, missing, ended, sql.ErrNoRows, nil} {
		if c.d.LockConflict(err) {
			t.Errorf("lockConflict(%v) = true for an error that is no lock conflict", err)
		}
	}
}

// RejectsData reports the engine's refusals of a value, and no other
// error: a JSON payload that encoding/json accepts and the engine's JSON
// does not, text that is not UTF-8, a number out of range, text longer than
// its column.
func checkRejectsData(t *testing.T, c *conformance) {
	id := c.put(t, "A", spec{})
	deep := c.event(dialect.Aggregate{Type: "agg", ID: "deep"})
	deep.Payload = strings.Repeat("[", 1001) + strings.Repeat("]", 1001)
	_, deepErr := c.insert(t, deep, false)
	refusals := map[string]error{"deeply nested JSON": deepErr}
	for _, v := range []struct {
		what, set string
		value     any
	}{
		{"not UTF-8", "last_error = ?", "\xff\xfe"},
		{"a NUL character", "last_error = ?", "a\x00b"},
		{"a number too large", "delivery_attempts = ? * 1024", 1 << 30}, // computed by the server: the driver refuses none
		{"1021 bytes", "aggregate_id = ?", strings.Repeat("x", 1021)},
	} {
		_, refusals[v.what] = c.pool().ExecContext(ctx, c.sql(`UPDATE {records} SET `+v.set+` WHERE id = ?`), v.value, id)
	}
	refused := 0
	for what, err := range refusals {
		if err == nil {
			continue
		}
		refused++
		if !c.d.RejectsData(err) {
			t.Errorf("%s refused with %v: rejectsData false", what, err)
		}
	}
	if refused == 0 {
		t.Fatal("the engine refused none of the values")
	}
	clash := c.event(dialect.Aggregate{Type: "agg", ID: "A"})
	clash.ID = c.get(t, id).eventID
	_, duplicate := c.insert(t, clash, false)
	_, missing := c.pool().ExecContext(ctx, `SELECT * FROM conformance_missing`)
	for _, err := range []error{duplicate, missing, lockWaitError(t, c), context.Canceled} {
		if err == nil || c.d.RejectsData(err) {
			t.Errorf("rejectsData(%v) = true, or no error: want false for an error that refuses no value", err)
		}
	}
}

// InsertEvent numbers each aggregate's events from 1 without a gap,
// stores them as given, and stores nothing for a known idempotency key.
func checkInsertEvent(t *testing.T, c *conformance) {
	headers := `{"trace":"t-1","quote":"it's \"x\"","ünïcödé":"😀"}`
	a1 := c.event(dialect.Aggregate{Type: awkward[0], ID: awkward[9]})
	a1.Headers = &headers
	a1.Payload = `{"text": "ünïcödé 😀 \u2028", "list": [1, 2.5, null, true], "quote": "it's \"x\""}`
	if ok, err := c.insert(t, a1, false); !ok || err != nil {
		t.Fatalf("insertEvent = %v, %v", ok, err)
	}
	ra1 := c.idOf(t, a1.ID)
	s := c.get(t, ra1)
	switch {
	case s.seq != 1 || s.key != a1.Key || !sameJSON(s.payload, a1.Payload) || !sameJSON(s.headers.String, headers):
		t.Errorf("stored #%d, key %q, payload %s, headers %v; want #1, %q, %s, %s", s.seq, s.key, s.payload, s.headers, a1.Key, a1.Payload, headers)
	case s.state != StatePending || s.attempts != 0 || !s.locked.IsZero() || s.batch.Valid:
		t.Errorf("stored state %s, %d attempts, lease %v, batch %v; want a pending row", s.state, s.attempts, s.locked, s.batch)
	case !s.next.Equal(c.now) || !s.created.Equal(c.now) || !s.updated.Equal(c.now) || !s.occurred.Equal(a1.OccurredAt):
		t.Errorf("stored next %v, created %v, updated %v, occurred %v; want now (%v) and %v", s.next, s.created, s.updated, s.occurred, c.now, a1.OccurredAt)
	}
	if n := c.count(t, c.sql(`SELECT count(*) FROM {records} WHERE aggregate_type = ? AND aggregate_id = ?`), awkward[0], awkward[9]); n != 1 {
		t.Errorf("%d rows of the awkward aggregate, want 1", n)
	}
	ra2 := c.putEvent(t, c.event(dialect.Aggregate{Type: awkward[0], ID: awkward[9]}), spec{})
	rb1 := c.put(t, "B", spec{})
	for id, want := range map[int64]int64{ra2: 2, rb1: 1} {
		if got := c.get(t, id).seq; got != want {
			t.Errorf("row %d: sequence %d, want %d", id, got, want)
		}
	}

	// A known key: nothing stored, whatever the existing row's state, and
	// no sequence used.
	c.set(t, ra1, deliveredAt(c.now))
	dup := c.event(dialect.Aggregate{Type: awkward[0], ID: awkward[9]})
	dup.Key = a1.Key
	if ok, err := c.insert(t, dup, false); ok || err != nil {
		t.Fatalf("insertEvent of a known key = %v, %v; want false, nil", ok, err)
	}
	if s := c.get(t, ra1); s.eventID != a1.ID || s.state != StateDelivered {
		t.Errorf("the row of the known key became %s, %s", s.eventID, s.state)
	}
	if got := c.get(t, c.putEvent(t, c.event(dialect.Aggregate{Type: awkward[0], ID: awkward[9]}), spec{})).seq; got != 3 {
		t.Errorf("the event after a known key: sequence %d, want 3", got)
	}
	clash := c.event(dialect.Aggregate{Type: "agg", ID: "B"})
	clash.ID = a1.ID
	if ok, err := c.insert(t, clash, false); ok || err == nil {
		t.Errorf("insertEvent of a known event id under a new key = %v, %v; want an error", ok, err)
	}
	// Keys compare byte for byte.
	for _, k := range []string{"key", "Key", "key "} {
		e := c.event(dialect.Aggregate{Type: "agg", ID: "keys"})
		e.Key = k
		if ok, err := c.insert(t, e, false); !ok || err != nil {
			t.Errorf("insertEvent of key %q = %v, %v; want a new row", k, ok, err)
		}
	}
}

// skipWithOneStatementClaim skips the check of a step of a claim on an
// engine whose claim is one statement (checkClaim checks it there).
func skipWithOneStatementClaim(t *testing.T, c *conformance) {
	if c.st.Claim != "" {
		t.Skip("the claim is one statement (Claim)")
	}
}

func checkClaim(t *testing.T, c *conformance) {
	if c.st.Claim == "" {
		t.Skip("no one-statement claim: window, undelivered and lease run in claimTx")
	}
	type result struct {
		seen    int
		blocked bool
		leased  []int64
	}
	claim := func(batch string) result {
		t.Helper()
		res, err := c.pool().QueryContext(ctx, c.st.Claim, batch, c.ts(c.in(30*time.Second)), c.ts(c.now), 10)
		if err != nil {
			t.Fatal(err)
		}
		defer res.Close()
		var r result
		rows := 0
		for res.Next() {
			var (
				id   sql.NullInt64
				rest [10]any
			)
			dest := []any{&r.seen, &r.blocked, &id}
			for i := range rest {
				dest = append(dest, &rest[i])
			}
			if err := res.Scan(dest...); err != nil {
				t.Fatal(err)
			}
			rows++
			if id.Valid {
				r.leased = append(r.leased, id.Int64)
			}
		}
		if err := res.Err(); err != nil || rows == 0 {
			t.Fatalf("claim returned %d rows, %v; want at least one", rows, err)
		}
		slices.Sort(r.leased)
		return r
	}
	a1, a2 := c.put(t, "A", dueAt(c.ago(6*time.Minute))), c.put(t, "A", dueAt(c.ago(5*time.Minute)))
	b1, b2 := c.put(t, "B", retryAt(c.in(time.Hour))), c.put(t, "B", dueAt(c.ago(4*time.Minute)))
	c.put(t, "C", leasedUntil(c.in(time.Hour), "other"))
	c.put(t, "C", dueAt(c.ago(3*time.Minute)))
	d1, d2 := c.put(t, "D", dueAt(c.ago(2*time.Minute))), c.put(t, "D", dueAt(c.in(time.Hour)))
	d3 := c.put(t, "D", dueAt(c.ago(time.Minute)))

	// The window: a1, a2, b2, c2, d1, d3. b2 waits behind a retry, c2
	// behind a batch in flight, d3 behind a row that is not due.
	if r := claim("b1"); r.seen != 6 || !r.blocked || !slices.Equal(r.leased, []int64{a1, a2, d1}) {
		t.Fatalf("first claim: %+v; want 6 seen, blocked, leased %v", r, []int64{a1, a2, d1})
	}
	if s := c.get(t, a2); s.state != StateDelivering || s.batch.String != "b1" || !s.locked.Equal(c.in(30*time.Second)) ||
		!s.next.Equal(s.locked) || !s.updated.Equal(c.now) {
		t.Fatalf("a leased row: %+v", s)
	}
	c.set(t, b1, deliveredAt(c.now))
	c.set(t, d2, deliveredAt(c.now))
	if r := claim("b2"); r.seen != 3 || r.blocked || !slices.Equal(r.leased, []int64{b2, d3}) {
		t.Fatalf("second claim: %+v; want 3 seen (b2, c2, d3), not blocked (c2 waits for a batch in flight), leased %v", r, []int64{b2, d3})
	}
	if r := claim("b3"); r.seen != 1 || r.blocked || len(r.leased) != 0 {
		t.Fatalf("third claim: %+v; want 1 seen (c2), not blocked, nothing leased", r)
	}
	x := c.put(t, "X", dueAt(c.ago(10*time.Minute)))
	y := c.put(t, "Y", spec{})
	var got result
	overlapped := c.whileClaimHolds(t, func(q dialect.Querier) error {
		_, err := c.lockOldest(q, 1) // x
		return err
	}, func() error {
		got = claim("b4")
		return nil
	}, c.patience())
	if !overlapped || got.seen != 2 || !slices.Equal(got.leased, []int64{y}) {
		t.Fatalf("claim beside a claim holding %d: finished %v, %+v; want at once, c2 and %d seen, %d leased", x, overlapped, got, y, y)
	}
}

// The window is the oldest claimable rows, in due order: due, and not
// leased, whatever next_attempt_at says.
func checkWindow(t *testing.T, c *conformance) {
	skipWithOneStatementClaim(t, c)
	a1 := c.put(t, "A", dueAt(c.ago(5*time.Minute)))
	b1 := c.put(t, "B", retryAt(c.ago(4*time.Minute)))
	expired := c.put(t, "C", leasedUntil(c.ago(3*time.Minute), "dead"))
	c.put(t, "D", leasedUntil(c.in(time.Hour), "live"))
	c.put(t, "E", spec{next: c.ago(10 * time.Minute), locked: c.in(time.Hour)}) // locked, though due
	c.put(t, "F", dueAt(c.in(time.Minute)))
	c.put(t, "G", deliveredAt(c.ago(time.Hour)))
	c.put(t, "H", failedAt(c.ago(time.Hour), failurePermanent, 0))
	a2 := c.put(t, "A", dueAt(c.ago(2*time.Minute)))
	edge := c.put(t, "I", dueAt(c.now))
	c.claimTx(t, func(q dialect.Querier) error {
		for _, tc := range []struct {
			limit int
			want  []int64
		}{{10, []int64{a1, b1, expired, a2, edge}}, {2, []int64{a1, b1}}} {
			rows, err := queryRows(ctx, q, c.st.Window, c.ts(c.now), tc.limit)
			if err != nil {
				return err
			}
			if !slices.Equal(ids(rows), tc.want) {
				t.Errorf("window of %d: %v, want %v", tc.limit, ids(rows), tc.want)
			}
			for _, r := range rows {
				if r.id == a2 && (r.agg != dialect.Aggregate{Type: "agg", ID: "A"} || r.seq != 2) {
					t.Errorf("window row %d: %+v, want agg/A #2", a2, r)
				}
			}
		}
		return nil
	})
}

// The order check answers, per event in the list's order: NULL when it is
// delivered or gone; 'flight' when it is leased, or due no later than the
// event after it; 'waits' otherwise.
func checkUndelivered(t *testing.T, c *conformance) {
	skipWithOneStatementClaim(t, c)
	ev := func(agg string, seq int64) dialect.Position {
		return dialect.Position{Aggregate: dialect.Aggregate{Type: "agg", ID: agg}, Seq: seq}
	}
	pair := func(agg string, first, second spec) {
		c.put(t, agg, first)
		c.put(t, agg, second)
	}
	pair("delivered", deliveredAt(c.ago(time.Hour)), spec{})
	pair("leased", leasedUntil(c.in(time.Hour), "live"), spec{})
	pair("earlier", dueAt(c.ago(2*time.Minute)), dueAt(c.ago(time.Minute)))
	pair("same", dueAt(c.ago(time.Minute)), dueAt(c.ago(time.Minute)))
	pair("retry", retryAt(c.in(time.Hour)), spec{})
	pair("failed", failedAt(c.ago(time.Hour), failurePermanent, 0), spec{})
	pair("expired", leasedUntil(c.ago(time.Minute), "dead"), dueAt(c.ago(2*time.Minute)))
	pair("later", dueAt(c.ago(time.Minute)), dueAt(c.ago(2*time.Minute)))
	ask := []dialect.Position{ev("delivered", 1), ev("gone", 7), ev("leased", 1), ev("earlier", 1), ev("same", 1),
		ev("retry", 1), ev("failed", 1), ev("expired", 1), ev("later", 1), ev("leased", 1)}
	want := []string{"", "", "flight", "flight", "flight", "waits", "waits", "waits", "waits", "flight"}
	c.claimTx(t, func(q dialect.Querier) error {
		got, err := queryStates(ctx, q, len(ask), c.st.Undelivered, append([]any{c.ts(c.now)}, c.d.EventList(ask)...)...)
		if err != nil {
			return err
		}
		for i, st := range got {
			if st.String != want[i] || st.Valid != (want[i] != "") {
				t.Errorf("%s #%d: %v, want %q", ask[i].Aggregate.ID, ask[i].Seq, st, want[i])
			}
		}
		return nil
	})
}

// Lease: leases the listed rows, and returns what a message needs.
func checkLease(t *testing.T, c *conformance) {
	skipWithOneStatementClaim(t, c)
	headers := `{"h":"v"}`
	e1 := c.event(dialect.Aggregate{Type: "agg", ID: "A"})
	e1.Headers = &headers
	r1 := c.putEvent(t, e1, spec{attempts: 2})
	r2 := c.put(t, "B", spec{})
	e3 := c.event(dialect.Aggregate{Type: "agg", ID: "C"})
	r3 := c.putEvent(t, e3, retryAt(c.ago(time.Minute)))
	var leased []claimed
	c.claimTx(t, func(q dialect.Querier) error {
		res, err := q.QueryContext(ctx, c.st.Lease, "b1", c.ts(c.in(30*time.Second)), c.ts(c.now), c.d.IDList([]int64{r3, r1}))
		if err != nil {
			return err
		}
		defer res.Close()
		leased, err = scanLeased(res, 2)
		return err
	})
	slices.SortFunc(leased, func(a, b claimed) int { return int(a.id - b.id) })
	if len(leased) != 2 || leased[0].id != r1 || leased[1].id != r3 {
		t.Fatalf("leased %+v, want rows %d and %d", leased, r1, r3)
	}
	for i, tc := range []struct {
		e        dialect.Record
		attempts int
		headers  map[string]string
	}{{e1, 2, map[string]string{"h": "v"}}, {e3, 0, nil}} {
		m := leased[i].msg
		if leased[i].bad != nil || m.EventID != tc.e.ID || m.EventType != tc.e.Type || m.AggregateType != tc.e.AggregateType ||
			m.AggregateID != tc.e.AggregateID || m.Sequence != 1 || m.IdempotencyKey != tc.e.Key ||
			!sameJSON(string(m.Payload), tc.e.Payload) || !maps.Equal(m.Headers, tc.headers) ||
			!m.OccurredAt.Equal(tc.e.OccurredAt) || leased[i].attempts != tc.attempts {
			t.Errorf("leased %+v (%d attempts, bad %v); want event %+v, %d attempts", m, leased[i].attempts, leased[i].bad, tc.e, tc.attempts)
		}
	}
	for _, id := range []int64{r1, r3} {
		if s := c.get(t, id); s.state != StateDelivering || s.batch.String != "b1" || !s.locked.Equal(c.in(30*time.Second)) ||
			!s.next.Equal(s.locked) || !s.updated.Equal(c.now) {
			t.Errorf("leased row %d: %+v", id, s)
		}
	}
	if s := c.get(t, r2); s.state != StatePending || s.batch.Valid {
		t.Errorf("row %d, not listed: %+v", r2, s)
	}
}

// settleDelivered marks delivered the listed rows that the batch still
// leases, and no other.
func checkSettleDelivered(t *testing.T, c *conformance) {
	leased := leasedUntil(c.in(time.Minute), "b1")
	leased.attempts, leased.lastErr = 1, "earlier failure"
	m1, m2 := c.put(t, "A", leased), c.put(t, "B", leased)
	m3 := c.put(t, "C", leasedUntil(c.in(time.Minute), "b2"))
	m4 := c.put(t, "D", spec{})
	m5 := c.put(t, "E", spec{state: StateDelivered, batch: "b1", delivered: c.ago(time.Hour)})
	if n := c.exec(t, c.st.SettleDelivered, c.ts(c.now), "b1", c.d.IDList([]int64{m1, m3, m4, m5})); n != 1 {
		t.Errorf("settled %d rows, want 1", n)
	}
	if s := c.get(t, m1); s.state != StateDelivered || s.attempts != 2 || !s.next.Equal(c.now) || s.lastErr.Valid ||
		s.kind.Valid || !s.locked.IsZero() || !s.delivered.Equal(c.now) || !s.updated.Equal(c.now) {
		t.Errorf("settled row: %+v", s)
	}
	for id, want := range map[int64]string{m2: StateDelivering, m3: StateDelivering, m4: StatePending} {
		if s := c.get(t, id); s.state != want || !s.delivered.IsZero() {
			t.Errorf("row %d: %s, delivered at %v; want it left %s", id, s.state, s.delivered, want)
		}
	}
	if s := c.get(t, m5); !s.delivered.Equal(c.ago(time.Hour)) {
		t.Errorf("a row delivered before: delivered at %v again", s.delivered)
	}
}

// settleOther sets the outcome on the listed rows the batch still leases;
// a NULL last error keeps the one before.
func checkSettleOther(t *testing.T, c *conformance) {
	leased := leasedUntil(c.in(time.Minute), "b1")
	leased.lastErr = "first failure"
	o1, o2, o4 := c.put(t, "A", leased), c.put(t, "B", leased), c.put(t, "D", leased)
	o3 := c.put(t, "C", leasedUntil(c.in(time.Minute), "b2"))
	settle := func(state string, attempts int, next time.Time, lastErr, kind any, ids ...int64) int64 {
		return c.exec(t, c.st.SettleOther, state, attempts, c.ts(next), lastErr, kind, c.ts(c.now), "b1", c.d.IDList(ids))
	}
	reason := `boom: 'quoted' "x" ünïcödé 😀`
	if n := settle(StateRetry, 3, c.in(time.Minute), reason, nil, o1, o3); n != 1 {
		t.Errorf("retry settled %d rows, want 1", n)
	}
	if n := settle(StatePending, 1, c.now, nil, nil, o2); n != 1 {
		t.Errorf("not attempted settled %d rows, want 1", n)
	}
	if n := settle(StateFailed, 10, c.now, "gave up", failureExhausted, o4); n != 1 {
		t.Errorf("dead letter settled %d rows, want 1", n)
	}
	for _, tc := range []struct {
		id               int64
		state, err, kind string
		attempts         int
		next             time.Time
	}{
		{o1, StateRetry, reason, "", 3, c.in(time.Minute)},
		{o2, StatePending, "first failure", "", 1, c.now},
		{o4, StateFailed, "gave up", failureExhausted, 10, c.now},
	} {
		s := c.get(t, tc.id)
		if s.state != tc.state || s.lastErr.String != tc.err || s.kind.String != tc.kind || s.attempts != tc.attempts ||
			!s.next.Equal(tc.next) || !s.locked.IsZero() || !s.updated.Equal(c.now) {
			t.Errorf("row %d: %+v; want %s, %d attempts, next %v, error %q, kind %q", tc.id, s, tc.state, tc.attempts, tc.next, tc.err, tc.kind)
		}
	}
	if s := c.get(t, o3); s.state != StateDelivering {
		t.Errorf("another batch's row: %s", s.state)
	}
}

// Blockers: the heads that hold due rows of their aggregate back, seen
// among the scan oldest due rows, and until when those rows should wait.
func checkBlockers(t *testing.T, c *conformance) {
	leaseEnd := c.in(30 * time.Second)
	pair := func(agg string, head, next spec) {
		c.put(t, agg, head)
		c.put(t, agg, next)
	}
	pair("F", failedAt(c.ago(time.Hour), failurePermanent, 0), dueAt(c.ago(10*time.Minute)))
	pair("R", retryAt(c.in(time.Hour)), dueAt(c.ago(9*time.Minute)))
	pair("K", dueAt(c.ago(8*time.Minute)), dueAt(c.ago(7*time.Minute)))
	pair("L", leasedUntil(c.in(time.Hour), "live"), dueAt(c.ago(6*time.Minute)))
	// Heads behind rows of their own that came due before them, outside
	// a scan of the four oldest due rows (E #2, E #3, P #2, P #3) or in
	// a longer one.
	c.put(t, "E", leasedUntil(c.ago(30*time.Second), "dead"))
	c.put(t, "E", dueAt(c.ago(25*time.Minute)))
	c.put(t, "E", dueAt(c.ago(24*time.Minute)))
	c.put(t, "P", dueAt(c.ago(time.Minute)))
	c.put(t, "P", dueAt(c.ago(20*time.Minute)))
	c.put(t, "P", dueAt(c.ago(19*time.Minute)))
	type found struct {
		agg   string
		seq   int64
		state string
		until time.Time
	}
	blockers := func(scan int) []found {
		res, err := c.pool().QueryContext(ctx, c.st.Blockers, c.ts(c.now), scan, c.ts(leaseEnd))
		if err != nil {
			t.Fatal(err)
		}
		defer res.Close()
		var out []found
		for res.Next() {
			var (
				f     found
				typ   string
				until dialect.Time
			)
			if err := res.Scan(&typ, &f.agg, &f.seq, &f.state, &until); err != nil {
				t.Fatal(err)
			}
			f.until = until.Time
			out = append(out, f)
		}
		if err := res.Err(); err != nil {
			t.Fatal(err)
		}
		slices.SortFunc(out, func(a, b found) int { return strings.Compare(a.agg, b.agg) })
		return out
	}
	for _, tc := range []struct {
		scan int
		want []found
	}{
		{100, []found{{"E", 1, StateDelivering, c.ago(30 * time.Second)}, {"F", 1, StateFailed, leaseEnd},
			{"P", 1, StatePending, c.ago(time.Minute)}, {"R", 1, StateRetry, c.in(time.Hour)}}},
		{4, []found{{"E", 1, StateDelivering, c.ago(30 * time.Second)}, {"P", 1, StatePending, c.ago(time.Minute)}}},
	} {
		got := blockers(tc.scan)
		same := len(got) == len(tc.want)
		for i := 0; same && i < len(got); i++ {
			g, w := got[i], tc.want[i]
			same = g.agg == w.agg && g.seq == w.seq && g.state == w.state && g.until.Equal(w.until)
		}
		if !same {
			t.Errorf("blockers among %d: %+v, want %+v", tc.scan, got, tc.want)
		}
	}
}

// Park moves the due rows behind a blocker to until, if the blocker is
// still in the state given.
func checkPark(t *testing.T, c *conformance) {
	until := c.in(time.Hour)
	c.put(t, "F", failedAt(c.ago(time.Hour), failurePermanent, 0))
	f2, f3 := c.put(t, "F", spec{}), c.put(t, "F", retryAt(c.ago(time.Minute)))
	f4, f5 := c.put(t, "F", dueAt(c.in(2*time.Hour))), c.put(t, "F", leasedUntil(c.ago(time.Minute), "dead"))
	c.put(t, "G", failedAt(c.ago(time.Hour), failurePermanent, 0))
	g2 := c.put(t, "G", spec{})
	park := func(agg, state string) int64 {
		return c.exec(t, c.st.Park, c.ts(until), c.ts(c.now), "agg", agg, 1, state)
	}
	if n := park("F", StateFailed); n != 2 {
		t.Errorf("parked %d rows, want 2", n)
	}
	if n := park("G", StateRetry); n != 0 {
		t.Errorf("parked %d rows behind a blocker no longer in that state", n)
	}
	for id, want := range map[int64]time.Time{f2: until, f3: until, f4: c.in(2 * time.Hour), f5: c.ago(time.Minute), g2: c.ago(time.Minute)} {
		if s := c.get(t, id); !s.next.Equal(want) {
			t.Errorf("row %d: next attempt %v, want %v", id, s.next, want)
		}
	}
	if s := c.get(t, f2); !s.updated.Equal(c.now) {
		t.Errorf("a parked row: updated %v, want now", s.updated)
	}
}

// Unpark makes the waiting rows of the listed aggregates due now.
func checkUnpark(t *testing.T, c *conformance) {
	later := c.in(time.Hour)
	c.put(t, "A", failedAt(c.ago(time.Hour), failureExhausted, 0))
	a2, a3 := c.put(t, "A", dueAt(later)), c.put(t, "A", retryAt(later))
	a4, a5 := c.put(t, "A", leasedUntil(later, "live")), c.put(t, "A", spec{})
	b1 := c.put(t, "B", dueAt(later))
	k1 := c.put(t, "K", dueAt(later))
	if n := c.exec(t, c.st.Unpark, append([]any{c.ts(c.now)}, c.d.EventList([]dialect.Position{{Aggregate: dialect.Aggregate{Type: "agg", ID: "A"}}, {Aggregate: dialect.Aggregate{Type: "agg", ID: "K"}}})...)...); n != 3 {
		t.Errorf("unparked %d rows, want 3", n)
	}
	for id, want := range map[int64]time.Time{a2: c.now, a3: c.now, k1: c.now, a4: later, a5: c.ago(time.Minute), b1: later} {
		if s := c.get(t, id); !s.next.Equal(want) {
			t.Errorf("row %d: next attempt %v, want %v", id, s.next, want)
		}
	}
}

// aggregatesOf runs a revive or requeue statement in a claim transaction
// and returns the aggregate ids it reports.
func (c *conformance) aggregatesOf(t *testing.T, query string, args ...any) []string {
	t.Helper()
	var out []string
	c.claimTx(t, func(q dialect.Querier) error {
		out = nil
		res, err := q.QueryContext(ctx, query, args...)
		if err != nil {
			return err
		}
		defer res.Close()
		for res.Next() {
			var k dialect.Aggregate
			if err := res.Scan(&k.Type, &k.ID); err != nil {
				return err
			}
			out = append(out, k.ID)
		}
		return res.Err()
	})
	slices.Sort(out)
	return out
}

// Revive moves back to pending, oldest failure first, the failed rows that
// ran out of attempts and were revived fewer than max times.
func checkRevive(t *testing.T, c *conformance) {
	f1Spec := failedAt(c.ago(3*time.Hour), failureExhausted, 0)
	f1Spec.batch, f1Spec.attempts = "old", 10
	f1 := c.put(t, "A", f1Spec)
	f2 := c.put(t, "B", failedAt(c.ago(4*time.Hour), failureExhausted, 2))
	f3 := c.put(t, "C", failedAt(c.ago(5*time.Hour), failurePermanent, 0))
	f4 := c.put(t, "D", failedAt(c.ago(2*time.Hour), failureExhausted, 1))
	f5 := c.put(t, "E", failedAt(c.ago(time.Hour), failureExhausted, 0))
	c.put(t, "F", spec{})
	if got := c.aggregatesOf(t, c.st.Revive, c.ts(c.now), 2, 2); !slices.Equal(got, []string{"A", "D"}) {
		t.Fatalf("revived %v, want A and D", got)
	}
	if s := c.get(t, f1); s.state != StatePending || s.attempts != 0 || s.revivals != 1 || s.kind.Valid || s.batch.Valid ||
		!s.locked.IsZero() || !s.next.Equal(c.now) || !s.updated.Equal(c.now) || s.lastErr.String != "failed" {
		t.Errorf("revived row: %+v; want pending, its revival counted, its last error kept", s)
	}
	if s := c.get(t, f4); s.revivals != 2 {
		t.Errorf("revived row: %d revivals, want 2", s.revivals)
	}
	for _, id := range []int64{f2, f3, f5} {
		if s := c.get(t, id); s.state != StateFailed {
			t.Errorf("row %d: %s, want it left failed", id, s.state)
		}
	}
}

// Requeue moves the failed rows its filter selects, oldest failure first,
// whatever their kind and revivals.
func checkRequeue(t *testing.T, c *conformance) {
	specs := map[string]spec{
		"A": failedAt(c.ago(3*time.Hour), failurePermanent, 3),
		"B": failedAt(c.ago(2*time.Hour), failureExhausted, 0),
		"C": failedAt(c.ago(time.Hour), failureExhausted, 1),
	}
	rows := map[string]int64{}
	for agg, typ := range map[string]string{"A": "t.a", "B": "t.b", "C": "t.a"} {
		e := c.event(dialect.Aggregate{Type: "agg", ID: agg})
		e.Type = typ
		rows[agg] = c.putEvent(t, e, specs[agg])
	}
	c.put(t, "P", spec{})
	for _, tc := range []struct {
		name       string
		limit      int
		before     any
		ids, types []string
		want       []string
	}{
		{"All", 10, nil, nil, nil, []string{"A", "B", "C"}},
		{"OldestFirst", 2, nil, nil, nil, []string{"A", "B"}},
		{"FailedBefore", 10, c.ts(c.ago(90 * time.Minute)), nil, nil, []string{"A", "B"}},
		{"EventIDs", 10, nil, []string{c.get(t, rows["B"]).eventID, "absent"}, nil, []string{"B"}},
		{"EventTypes", 10, nil, nil, []string{"t.a"}, []string{"A", "C"}},
		{"EmptyList", 10, nil, []string{}, nil, nil},
	} {
		for agg, id := range rows {
			c.set(t, id, specs[agg])
		}
		got := c.aggregatesOf(t, c.st.Requeue, c.ts(c.now), tc.limit, tc.before, c.d.TextList(tc.ids), c.d.TextList(tc.types))
		if !slices.Equal(got, tc.want) {
			t.Errorf("%s: requeued %v, want %v", tc.name, got, tc.want)
		}
		for agg, id := range rows {
			s := c.get(t, id)
			moved := slices.Contains(tc.want, agg)
			if moved && (s.state != StatePending || s.attempts != 0 || s.revivals != 0 || s.kind.Valid || !s.next.Equal(c.now)) ||
				!moved && s.state != StateFailed {
				t.Errorf("%s: row %s after: %+v (moved %v)", tc.name, agg, s, moved)
			}
		}
	}
}

// Cleanup deletes up to limit delivered rows delivered before the cutoff,
// oldest first.
func checkCleanup(t *testing.T, c *conformance) {
	d1, d2 := c.put(t, "A", deliveredAt(c.ago(3*time.Hour))), c.put(t, "B", deliveredAt(c.ago(2*time.Hour)))
	d3 := c.put(t, "C", deliveredAt(c.ago(30*time.Minute)))
	p, f := c.put(t, "D", spec{}), c.put(t, "E", failedAt(c.ago(5*time.Hour), failurePermanent, 0))
	left := func() []int64 {
		var out []int64
		for _, id := range []int64{d1, d2, d3, p, f} {
			if c.count(t, c.sql(`SELECT count(*) FROM {records} WHERE id = ?`), id) == 1 {
				out = append(out, id)
			}
		}
		return out
	}
	for _, want := range [][]int64{{d2, d3, p, f}, {d3, p, f}, {d3, p, f}} {
		c.exec(t, c.st.Cleanup, c.ts(c.ago(time.Hour)), 1)
		if got := left(); !slices.Equal(got, want) {
			t.Fatalf("rows left after a cleanup of 1: %v, want %v", got, want)
		}
	}
}

func checkCounts(t *testing.T, c *conformance) {
	for agg, s := range map[string]spec{"A": {}, "B": {}, "C": leasedUntil(c.in(time.Minute), "b"),
		"D": deliveredAt(c.now), "E": deliveredAt(c.now), "F": deliveredAt(c.now), "G": retryAt(c.now),
		"H": failedAt(c.now, failurePermanent, 0)} {
		c.put(t, agg, s)
	}
	res, err := c.pool().QueryContext(ctx, c.st.Counts)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Close()
	got := map[string]int64{}
	for res.Next() {
		var (
			state string
			n     int64
		)
		if err := res.Scan(&state, &n); err != nil {
			t.Fatal(err)
		}
		got[state] = n
	}
	want := map[string]int64{StatePending: 2, StateDelivering: 1, StateDelivered: 3, StateRetry: 1, StateFailed: 1}
	if !maps.Equal(got, want) {
		t.Fatalf("counts %v, want %v", got, want)
	}
}

// oldestDue is the next attempt of the longest-waiting claimable row, or
// NULL.
func checkOldestDue(t *testing.T, c *conformance) {
	oldest := func() time.Time {
		var at dialect.Time
		if err := c.pool().QueryRowContext(ctx, c.st.OldestDue, c.ts(c.now)).Scan(&at); err != nil {
			t.Fatal(err)
		}
		return at.Time
	}
	if got := oldest(); !got.IsZero() {
		t.Fatalf("oldest due of an empty table: %v", got)
	}
	c.put(t, "A", dueAt(c.in(time.Hour)))
	c.put(t, "B", leasedUntil(c.in(time.Hour), "live"))
	c.put(t, "C", spec{next: c.ago(3 * time.Hour), locked: c.in(time.Hour)})
	c.put(t, "D", failedAt(c.ago(4*time.Hour), failurePermanent, 0))
	c.put(t, "E", dueAt(c.ago(2*time.Hour)))
	c.put(t, "F", retryAt(c.ago(time.Hour)))
	if got := oldest(); !got.Equal(c.ago(2 * time.Hour)) {
		t.Fatalf("oldest due %v, want %v", got, c.ago(2*time.Hour))
	}
}

// lastFailure is the last error of the most recently failed row.
func checkLastFailure(t *testing.T, c *conformance) {
	older, newer := failedAt(c.ago(2*time.Hour), failurePermanent, 0), failedAt(c.ago(time.Hour), failureExhausted, 0)
	older.lastErr, newer.lastErr = "older", `newer: 'quoted' ünïcödé 😀`
	c.put(t, "A", newer)
	c.put(t, "B", older)
	retry := retryAt(c.now)
	retry.lastErr, retry.updated = "a retry", c.now
	c.put(t, "C", retry)
	var last sql.NullString
	if err := c.pool().QueryRowContext(ctx, c.st.LastFailure).Scan(&last); err != nil || last.String != newer.lastErr {
		t.Fatalf("last failure %v, %v; want %q", last, err, newer.lastErr)
	}
}

// The shards partition the aggregates: claims by shard, one per shard,
// read every claimable row once, each aggregate's rows in one shard, and
// nothing that is not claimable.
func checkShards(t *testing.T, c *conformance) {
	if c.st.ClaimShard == "" && c.st.WindowShard == "" {
		t.Skip("claims never read by shard")
	}
	want := map[int64]string{}
	for a := range 40 {
		agg := fmt.Sprint(a)
		for range 3 {
			want[c.put(t, agg, dueAt(c.ago(time.Minute)))] = agg
		}
		c.put(t, agg, dueAt(c.in(time.Hour)))
	}
	c.put(t, "leased", leasedUntil(c.in(time.Hour), "other"))
	shardOf := map[string]int{}
	seen := map[int64]bool{}
	for shard := range dialect.Shards {
		var got []int64
		if c.st.ClaimShard != "" {
			res, err := c.pool().QueryContext(ctx, c.st.ClaimShard, fmt.Sprint("s", shard), c.ts(c.in(30*time.Second)), c.ts(c.now), 1000, shard)
			if err != nil {
				t.Fatal(err)
			}
			for res.Next() {
				var (
					seen    int
					blocked bool
					id      sql.NullInt64
					rest    [10]any
				)
				dest := []any{&seen, &blocked, &id}
				for i := range rest {
					dest = append(dest, &rest[i])
				}
				if err := res.Scan(dest...); err != nil {
					t.Fatal(err)
				}
				if id.Valid {
					got = append(got, id.Int64)
				}
			}
			if err := errors.Join(res.Err(), res.Close()); err != nil {
				t.Fatal(err)
			}
		} else {
			c.claimTx(t, func(q dialect.Querier) error {
				rows, err := queryRows(ctx, q, c.st.WindowShard, c.ts(c.now), 1000, shard)
				got = ids(rows)
				return err
			})
		}
		for _, id := range got {
			agg, ok := want[id]
			switch {
			case !ok:
				t.Errorf("shard %d read row %d, which is not claimable", shard, id)
			case seen[id]:
				t.Errorf("row %d read twice", id)
			case shardOf[agg] != 0 && shardOf[agg] != shard+1:
				t.Errorf("aggregate %s in shards %d and %d", agg, shardOf[agg]-1, shard)
			}
			seen[id], shardOf[agg] = true, shard+1
		}
	}
	if len(seen) != len(want) {
		t.Errorf("the shards read %d of the %d claimable rows", len(seen), len(want))
	}
	used := map[int]bool{}
	for _, s := range shardOf {
		used[s] = true
	}
	if len(used) < dialect.Shards/2 {
		t.Errorf("40 aggregates fell into %d of %d shards", len(used), dialect.Shards)
	}
}

// A shard's window reads the table through the index that migration 3
// made for it, never all of it: the planner knows, from the statistics on
// the shard hash, that a shard holds an eighth of the due rows
// (PostgreSQL does not use the statistics of a partial index's
// expression). Without them it read and sorted the whole table.
func checkShardWindowPlan(t *testing.T, c *conformance) {
	if c.e != outboxtest.Postgres {
		t.Skip("the plan is PostgreSQL's; MySQL's window names its shard column, SQLite has no shards")
	}
	c.exec(t, c.sql(`INSERT INTO {records} (event_id, event_type, aggregate_type, aggregate_id, aggregate_sequence,
	idempotency_key, payload, delivery_state, next_attempt_at, occurred_at, created_at, updated_at)
SELECT 'e' || g, 't', 'order', (g % 1000)::text, g / 1000 + 1, 'k' || g, '{}', 'pending',
	?::timestamptz + g * interval '1 ms', ?, ?, ?
FROM generate_series(0, 19999) g`), c.ts(c.ago(time.Hour)), c.ts(c.now), c.ts(c.now), c.ts(c.now))
	c.exec(t, `ANALYZE `+c.tb.Records)
	var doc string
	if err := c.pool().QueryRowContext(ctx, `EXPLAIN (FORMAT JSON) `+c.st.ClaimShard,
		"b", c.ts(c.in(30*time.Second)), c.ts(c.now), 1000, 3).Scan(&doc); err != nil {
		t.Fatal(err)
	}
	var plans []struct{ Plan map[string]any }
	if err := json.Unmarshal([]byte(doc), &plans); err != nil || len(plans) != 1 {
		t.Fatalf("plan %.300s: %v", doc, err)
	}
	var window map[string]any
	var find func(n map[string]any)
	find = func(n map[string]any) {
		if n["Subplan Name"] == "CTE w" {
			window = n
		}
		for _, child := range asNodes(n["Plans"]) {
			find(child)
		}
	}
	find(plans[0].Plan)
	if window == nil {
		t.Fatalf("no CTE w in the plan %.500s", doc)
	}
	var nodes []string
	var walk func(n map[string]any)
	walk = func(n map[string]any) {
		if n["Relation Name"] != nil || n["Index Name"] != nil {
			nodes = append(nodes, fmt.Sprint(n["Node Type"], " ", n["Index Name"]))
		}
		for _, child := range asNodes(n["Plans"]) {
			walk(child)
		}
	}
	walk(window)
	index := false
	for _, n := range nodes {
		index = index || strings.HasSuffix(n, " "+conformanceTable+"_due_shard")
		if strings.HasPrefix(n, "Seq Scan") {
			index = false
			break
		}
	}
	if !index {
		t.Fatalf("the shard window reads %q, want the index %s_due_shard and no sequential scan", nodes, conformanceTable)
	}
}

// asNodes returns the child plans of an EXPLAIN (FORMAT JSON) node.
func asNodes(v any) []map[string]any {
	list, _ := v.([]any)
	out := make([]map[string]any, 0, len(list))
	for _, x := range list {
		if n, ok := x.(map[string]any); ok {
			out = append(out, n)
		}
	}
	return out
}
