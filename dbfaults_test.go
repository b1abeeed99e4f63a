package outbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// TestPostgresConnectionsTerminatedMidRun terminates, again and again, the
// server connections of four writers and two dispatchers while they work
// (pg_terminate_backend, as a failover or an administrator would). Writers
// see errors; a commit that fails is ambiguous and is resolved from the
// database afterwards. The dispatchers must recover by themselves: every
// committed event is delivered, in order per aggregate, nothing of a
// transaction that did not commit is, and no row is left delivering.
//
// Only this test's connections are terminated (they are found by their
// application_name), so it runs in parallel with the other parallel
// top-level tests, after the sequential ones.
func TestPostgresConnectionsTerminatedMidRun(t *testing.T) {
	t.Parallel()
	r := startFaultRun(t, 4, 2)
	var terminated, rounds int
	byRole := map[string]int{}
	stop := time.Now().Add(5 * time.Second)
	for time.Now().Before(stop) {
		time.Sleep(150*time.Millisecond + rand.N(300*time.Millisecond))
		var victims []struct {
			PID             int `gorm:"column:pid"`
			ApplicationName string
		}
		mustNil(t, r.b.db.Raw(`SELECT pid, application_name FROM pg_stat_activity WHERE starts_with(application_name, ?)`, r.tag+"_").Scan(&victims).Error)
		rounds++
		for _, v := range victims {
			var ok bool
			if err := r.b.db.Raw(`SELECT pg_terminate_backend(?)`, v.PID).Scan(&ok).Error; err == nil && ok {
				terminated++
				byRole[strings.TrimPrefix(v.ApplicationName, r.tag+"_")]++
			}
		}
	}
	res := r.finish(t, 30*time.Second)
	summary(t, "connection faults (Postgres): %d connections terminated in %d rounds (%d of writers, %d of dispatchers); %s",
		terminated, rounds, byRole["writer"], byRole["dispatcher"], res)
	if byRole["writer"] == 0 || byRole["dispatcher"] == 0 {
		t.Errorf("terminated %v connections: want both writers' and dispatchers'", byRole)
	}
}

// TestPostgresServerRestartMidRun restarts the PostgreSQL server under four
// writers and two dispatchers (pg_ctlcluster restart, a fast shutdown that
// flushes the WAL). It does not run in parallel with anything (no
// t.Parallel, here or in a subtest), keeps other processes' tests off the
// server while it restarts it (outboxtest.ExclusiveServer), waits for the
// server to accept connections again, and skips when the machine does not
// allow the restart. The dispatchers must recover by themselves, with the same
// guarantees as under terminated connections.
func TestPostgresServerRestartMidRun(t *testing.T) {
	serverRestartMidRun(t, "fast")
}

// TestPostgresServerCrashMidRun does the same with an immediate shutdown,
// which is a crash: the server recovers from its WAL at start, and forgets
// the dispatchers' last claims and settles, whose commits did not wait for
// their WAL (see Dispatcher). Their events may then be accepted again
// without a failed settle or a lost lease to explain it; every other
// guarantee holds as after a clean restart.
func TestPostgresServerCrashMidRun(t *testing.T) {
	serverRestartMidRun(t, "immediate")
}

// serverRestartMidRun restarts the server with pg_ctlcluster's shutdown
// mode under a fault run, and checks the run.
func serverRestartMidRun(t *testing.T, mode string) {
	restart := restartCommand(t, mode)
	r := startFaultRun(t, 4, 2)
	startedAt := func() (time.Time, error) {
		var at time.Time
		err := r.b.db.Raw(`SELECT pg_postmaster_start_time()`).Scan(&at).Error
		return at, err
	}
	before, err := startedAt()
	mustNil(t, err)
	// Other packages' tests use the server too: they wait, and it waits
	// for theirs to end, until it answers again.
	release := outboxtest.ExclusiveServer(t, outboxtest.Postgres, 2*time.Minute)
	time.Sleep(500 * time.Millisecond)
	// A settle committed a second before the crash has been flushed by
	// then (by the WAL writer, and by the writers' synchronous commits).
	recent := len(r.acc.all())
	time.Sleep(time.Second)
	crashAt := len(r.acc.all())
	began := time.Now()
	out, err := exec.Command(restart[0], restart[1:]...).CombinedOutput()
	down := time.Since(began)
	back := waitForServer(t, 60*time.Second)
	upAgain := time.Since(began)
	release()
	if err != nil {
		r.abort()
		if !back {
			t.Fatalf("%v failed (%v: %s) and the server does not answer any more", restart, err, out)
		}
		t.Skipf("skipping: the machine does not allow restarting PostgreSQL: %v: %v: %s", restart, err, out)
	}
	if !back {
		t.Fatalf("the server does not accept connections a minute after %v", restart)
	}
	var after time.Time
	for range 50 {
		if after, err = startedAt(); err == nil {
			break
		}
		time.Sleep(100 * time.Millisecond)
	}
	mustNil(t, err)
	if after.Equal(before) {
		r.abort()
		t.Skipf("skipping: %v did not restart the server the tests use (OUTBOX_POSTGRES_DSN names another one)", restart)
	}
	if mode == "immediate" {
		r.crash = &crashWindow{recent: recent, at: crashAt, back: len(r.acc.all())}
	}
	time.Sleep(1500 * time.Millisecond)
	res := r.finish(t, 30*time.Second)
	summary(t, "server %s (Postgres): pg_ctlcluster restart -m %s took %v, the server accepted connections again %v after it began; %s",
		map[string]string{"fast": "restart", "immediate": "crash"}[mode], mode, down.Round(100*time.Millisecond), upAgain.Round(100*time.Millisecond), res)
}

// restartEnv names the environment variable that allows tests to restart
// or crash the PostgreSQL server they use: never by default, on a laptop's
// shared server.
const restartEnv = "OUTBOX_TEST_RESTART_POSTGRES"

// restartCommand returns the command that restarts the local PostgreSQL
// cluster with the given shutdown mode, or skips the test when there is
// none.
func restartCommand(t *testing.T, mode string) []string {
	t.Helper()
	if os.Getenv(restartEnv) != "1" {
		t.Skipf("skipping: this test restarts the PostgreSQL server; set %s=1 to run it (.ci/run does)", restartEnv)
	}
	bin, err := exec.LookPath("pg_ctlcluster")
	if err != nil {
		t.Skip("skipping: pg_ctlcluster is not installed, so the server cannot be restarted from here")
	}
	versions, _ := filepath.Glob("/etc/postgresql/*/main")
	if len(versions) != 1 {
		t.Skipf("skipping: want exactly one PostgreSQL cluster named main under /etc/postgresql, found %v", versions)
	}
	version := filepath.Base(filepath.Dir(versions[0]))
	return []string{bin, "--skip-systemctl-redirect", "--mode", mode, version, "main", "restart"}
}

// waitForServer waits until a fresh connection to the test server answers.
func waitForServer(t *testing.T, timeout time.Duration) bool {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		db, err := sql.Open("pgx", outboxtest.PostgresDSN())
		if err == nil {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			err = db.PingContext(ctx)
			cancel()
			db.Close()
			if err == nil {
				return true
			}
		}
		time.Sleep(200 * time.Millisecond)
	}
	return false
}

// faultRun is writers and dispatchers at work on PostgreSQL, each on a
// connection pool of its own whose application_name starts with tag, so
// that a test can find and terminate their server connections.
type faultRun struct {
	b      bundle
	tag    string
	cancel context.CancelFunc
	wg     sync.WaitGroup // writers
	dwg    sync.WaitGroup // dispatchers
	stopW  atomic.Bool
	logs   *logWatch
	acc    *acceptLog

	mu          sync.Mutex
	txs         []faultTx
	writeErrors int
	crash       *crashWindow // nil when the run had no crash
}

// crashWindow locates a crash of the server in the acceptance log, by how
// many acceptances there were a second before it, when it began, and once
// the server answered again. Since the dispatchers' claims and settles
// commit asynchronously, the crash may have forgotten
//   - the settle of an event accepted between recent and back, which is
//     then accepted again after at, though no settle failed;
//   - a lease, so that another dispatcher accepts the event first, and the
//     one whose lease was forgotten accepts it again and then finds its
//     lease gone at the settle (lateLost).
type crashWindow struct{ recent, at, back int }

// explains reports whether the crash explains acceptance i of an event
// whose previous acceptance was prev.
func (c *crashWindow) explains(prev, i int, lateLost bool) bool {
	return c != nil && i >= c.at && (lateLost || (prev >= c.recent && prev < c.back))
}

// faultTx is one writer transaction and what the writer knows of its fate.
type faultTx struct {
	key    string
	events int
	// single: a lone db.Create, whose one event is the plugin's (no "p-"
	// event).
	single bool
	// outcome: "committed" when Commit returned nil, "failed" when an
	// earlier statement failed (the transaction cannot have committed),
	// "ambiguous" when Commit itself failed.
	outcome string
}

var faultRunSeq atomic.Int64

func startFaultRun(t *testing.T, writers, dispatchers int) *faultRun {
	t.Helper()
	b := setup(t, outboxtest.Postgres, nil)
	return startFaultRunOn(t, b, writers, dispatchers, func(tag, role string, cfg *gorm.Config) *gorm.DB {
		return outboxtest.Reopen(t, outboxtest.DB{Engine: outboxtest.Postgres, DSN: b.info.DSN + " application_name=" + tag + "_" + role}, cfg)
	})
}

// startFaultRunOn is startFaultRun on b, with the writers' and the
// dispatchers' pools from open (role "writer" or "dispatcher").
func startFaultRunOn(t *testing.T, b bundle, writers, dispatchers int, open func(tag, role string, cfg *gorm.Config) *gorm.DB) *faultRun {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &faultRun{b: b, tag: fmt.Sprintf("outbox_fault_%d_%d", os.Getpid(), faultRunSeq.Add(1)), cancel: cancel,
		logs: &logWatch{}, acc: newAcceptLog(b.db)}
	t.Cleanup(r.abort)
	for i := range dispatchers {
		db := open(r.tag, "dispatcher", nil)
		mustNil(t, db.Use(outbox.Plugin()))
		d := newDispatcher(t, db, r.acc, outbox.WithLogger(slog.New(r.logs)),
			outbox.WithLease(2*time.Second), outbox.WithPublishTimeout(time.Second), outbox.WithBatchSize(20),
			outbox.WithPollInterval(20*time.Millisecond), outbox.WithMaxAttempts(1000),
			outbox.WithRetryPolicy(outbox.RetryPolicyFunc(func(int, error) time.Duration { return 50 * time.Millisecond })))
		r.dwg.Add(1)
		go func() {
			defer r.dwg.Done()
			if err := d.Run(ctx); err != nil {
				t.Errorf("dispatcher %d: Run: %v", i, err)
			}
		}()
	}
	for w := range writers {
		// Writers take turns at the three kinds of transaction an event
		// can be written in: the caller's own, GORM's default one around
		// a single statement, and the plugin's (SkipDefaultTransaction).
		mode := []string{"explicit", "default", "skip-default"}[w%3]
		cfg := &gorm.Config{SkipDefaultTransaction: mode == "skip-default"}
		db := open(r.tag, "writer", cfg)
		mustNil(t, db.Use(outbox.Plugin()))
		r.wg.Add(1)
		go func() {
			defer r.wg.Done()
			for i := 0; !r.stopW.Load(); i++ {
				time.Sleep(rand.N(20 * time.Millisecond))
				tx := r.write(db, fmt.Sprintf("w%d-%d", w, i), mode)
				r.mu.Lock()
				r.txs = append(r.txs, tx)
				if tx.outcome != "committed" {
					r.writeErrors++
				}
				r.mu.Unlock()
				if tx.outcome != "committed" {
					time.Sleep(50 * time.Millisecond)
				}
			}
		}()
	}
	return r
}

// write runs one writer transaction. In an explicit transaction: an order
// whose status is key, an event "p-"+key on it, and now and then one on a
// shared aggregate. Otherwise, a single db.Create of the order (its one
// event is the plugin's), whose failure is always ambiguous: it may have
// come from the commit.
func (r *faultRun) write(db *gorm.DB, key, mode string) faultTx {
	tx := faultTx{key: key, outcome: "failed"}
	if mode != "explicit" {
		tx.events, tx.single = 1, true
		tx.outcome = "committed"
		if db.Create(&Order{Status: key}).Error != nil {
			tx.outcome = "ambiguous"
		}
		return tx
	}
	t := db.Begin()
	if t.Error != nil {
		return tx
	}
	o := Order{Status: key}
	err := t.Create(&o).Error
	tx.events++
	if err == nil {
		err = outbox.Publish(t, outbox.Event{ID: "p-" + key, IdempotencyKey: "p-" + key, Type: "order.noted",
			AggregateType: "order", AggregateID: fmt.Sprint(o.ID), Payload: map[string]string{"tx": key}})
		tx.events++
	}
	if err == nil && rand.IntN(3) == 0 {
		err = outbox.Publish(t, outbox.Event{Type: "shop.counted", AggregateType: "shop", AggregateID: "all"})
		tx.events++
	}
	if err != nil {
		t.Rollback()
		return tx
	}
	if t.Commit().Error != nil {
		tx.outcome = "ambiguous"
		return tx
	}
	tx.outcome = "committed"
	return tx
}

// abort stops writers and dispatchers without checking anything.
func (r *faultRun) abort() {
	r.stopW.Store(true)
	r.wg.Wait()
	r.cancel()
	r.dwg.Wait()
}

// finish stops the writers, lets the dispatchers deliver everything
// (within timeout), stops them, checks the guarantees and returns the
// figures of the run.
func (r *faultRun) finish(t *testing.T, timeout time.Duration) string {
	t.Helper()
	r.stopW.Store(true)
	r.wg.Wait()
	waitAllDelivered(t, r.b.db, timeout)
	r.cancel()
	r.dwg.Wait()

	var delivering int64
	mustNil(t, r.b.db.Raw(`SELECT count(*) FROM outbox_records WHERE delivery_state = 'delivering'`).Scan(&delivering).Error)
	if delivering != 0 {
		t.Errorf("%d rows left delivering", delivering)
	}
	rows := r.b.records(t)
	inTable := map[string]bool{}
	for _, row := range rows {
		inTable[row.EventID] = true
	}
	var statuses []string
	mustNil(t, r.b.db.Model(&Order{}).Pluck("status", &statuses).Error)
	hasOrder := map[string]bool{}
	for _, s := range statuses {
		hasOrder[s] = true
	}
	counts := map[string]int{}
	wantEvents := 0
	for _, tx := range r.txs {
		has, ev := hasOrder[tx.key], inTable["p-"+tx.key]
		if tx.single {
			ev = has // checked below, with every order's creation event
		}
		if has != ev {
			t.Errorf("transaction %s (%s): business row %v but its event %v: not atomic", tx.key, tx.outcome, has, ev)
		}
		switch {
		case tx.outcome == "committed" && !has:
			t.Errorf("transaction %s: Commit returned nil, but its rows are missing", tx.key)
		case tx.outcome == "failed" && has:
			t.Errorf("transaction %s failed before its commit, but its rows exist", tx.key)
		case tx.outcome == "ambiguous" && has:
			counts["ambiguous, committed"]++
		case tx.outcome == "ambiguous":
			counts["ambiguous, rolled back"]++
		default:
			counts[tx.outcome]++
		}
		if has {
			wantEvents += tx.events
		}
	}
	// Atomicity over all writers: every order has its creation event, and
	// every creation event its order.
	var orphans, silent int64
	mustNil(t, r.b.db.Raw(`SELECT count(*) FROM outbox_records r WHERE r.event_type = 'order.create'
		AND NOT EXISTS (SELECT 1 FROM orders o WHERE concat(o.id) = r.aggregate_id)`).Scan(&orphans).Error)
	mustNil(t, r.b.db.Raw(`SELECT count(*) FROM orders o WHERE NOT EXISTS (SELECT 1 FROM outbox_records r
		WHERE r.event_type = 'order.create' AND r.aggregate_id = concat(o.id))`).Scan(&silent).Error)
	if orphans != 0 || silent != 0 {
		t.Errorf("%d creation events without their order, %d orders without their creation event", orphans, silent)
	}
	if len(rows) != wantEvents {
		t.Errorf("%d events in the table, want %d from the committed transactions", len(rows), wantEvents)
	}

	as := r.acc.all()
	redeliveries := checkAcceptances(t, as, inTable)
	timedOut := r.logs.timedOutBatches()
	prev := map[string]int{}
	crashRedeliveries := 0
	for i, a := range as {
		pi, again := prev[a.EventID]
		prev[a.EventID] = i
		p := as[pi]
		switch {
		case !again || timedOut[p.Batch] != "":
		case r.crash.explains(pi, i, timedOut[a.Batch] != ""):
			crashRedeliveries++
		default:
			t.Errorf("event %s (%s #%d) accepted again in batch %s after batch %s, whose settle neither failed nor lost its lease",
				a.EventID, a.Aggregate, a.Sequence, a.Batch, p.Batch)
		}
	}
	crashed := ""
	if r.crash != nil {
		crashed = fmt.Sprintf(", and %d redeliveries that only a claim or settle forgotten by the crash explains", crashRedeliveries)
	}
	return fmt.Sprintf("%d transactions committed (%d of them resolved from the database after an ambiguous failure), %d failed and rolled back (%d of them resolved from the database after an ambiguous failure); %d dispatch errors logged and recovered from; %d events, all delivered, none lost, none stuck in delivering; %d redeliveries, each after a failed settle or a lost lease%s",
		counts["committed"]+counts["ambiguous, committed"], counts["ambiguous, committed"], counts["failed"]+counts["ambiguous, rolled back"], counts["ambiguous, rolled back"],
		r.logs.errors(), len(rows), redeliveries-crashRedeliveries, crashed)
}

// acceptLog is an in-process publisher that accepts every batch and
// remembers what it accepted, after checking on its own connection that
// the business row of every order event is visible.
type acceptLog struct {
	observer *gorm.DB
	mu       sync.Mutex
	as       []acceptance
}

func newAcceptLog(observer *gorm.DB) *acceptLog { return &acceptLog{observer: observer} }

func (l *acceptLog) Publish(ctx context.Context, b outbox.Batch) error {
	batch := make([]acceptance, 0, len(b.Messages))
	for _, m := range b.Messages {
		a := acceptance{EventID: m.EventID, Type: m.EventType, Aggregate: m.AggregateType + "/" + m.AggregateID,
			Sequence: m.Sequence, Batch: b.ID, Attempt: m.Attempt, Visible: true}
		if m.AggregateType == "order" {
			var n int64
			if err := l.observer.WithContext(ctx).Raw(`SELECT count(*) FROM orders WHERE id = ?`, m.AggregateID).Scan(&n).Error; err != nil {
				return err
			}
			a.Visible = n == 1
		}
		batch = append(batch, a)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if err := ctx.Err(); err != nil {
		return err
	}
	l.as = append(l.as, batch...)
	return nil
}

func (l *acceptLog) all() []acceptance {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]acceptance(nil), l.as...)
}

// logWatch is a slog.Handler that keeps the dispatcher's warnings and
// errors, to explain redeliveries and count recovered errors.
type logWatch struct {
	mu    sync.Mutex
	lines []helperLogLine
}

func (w *logWatch) Enabled(_ context.Context, l slog.Level) bool { return l >= slog.LevelWarn }

func (w *logWatch) Handle(_ context.Context, r slog.Record) error {
	l := helperLogLine{Msg: r.Message, Level: r.Level.String()}
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "batch_id":
			l.BatchID = a.Value.String()
		case "error":
			l.Error = fmt.Sprint(a.Value.Any())
		}
		return true
	})
	w.mu.Lock()
	w.lines = append(w.lines, l)
	w.mu.Unlock()
	return nil
}

func (w *logWatch) WithAttrs([]slog.Attr) slog.Handler { return w }
func (w *logWatch) WithGroup(string) slog.Handler      { return w }

func (w *logWatch) timedOutBatches() map[string]string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return timedOutBatches(w.lines)
}

// errors counts the dispatch errors Run logged and went on from.
func (w *logWatch) errors() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, l := range w.lines {
		if l.Level == slog.LevelError.String() && l.Error != "" {
			n++
		}
	}
	return n
}
