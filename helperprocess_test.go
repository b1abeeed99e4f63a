package outbox_test

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// The test binary doubles as a dispatcher process: tests start copies of
// it with OUTBOX_HELPER=dispatcher to run dispatchers in other processes,
// and kill them.
func TestMain(m *testing.M) {
	if os.Getenv("OUTBOX_HELPER") == "dispatcher" {
		if err := runDispatcherProcess(); err != nil {
			fmt.Fprintln(os.Stderr, "dispatcher process:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// acceptance is one line of the file a dispatcher process appends to for
// every message its publisher accepts.
type acceptance struct {
	EventID   string `json:"event_id"`
	Type      string `json:"type"`
	Aggregate string `json:"aggregate"`
	Sequence  int64  `json:"seq"`
	PID       int    `json:"pid"`
	Batch     string `json:"batch"`
	// Visible says whether the business row of an order event was visible
	// on the publisher's own connection when it accepted the event.
	Visible bool `json:"visible"`
	Attempt int  `json:"attempt"`
}

// helperConfig is what a dispatcher process is told through its
// environment.
type helperConfig struct {
	Engine    outboxtest.Engine
	DSN       string
	Out       string
	Lease     time.Duration
	FailEvery int // every n-th batch fails as a whole; 0 never
	// Log, when set, is a file the process appends its dispatcher log to
	// (JSON lines, level info and above, each with the process id), along
	// with a "helper: publish" line when a publish starts and when it
	// returns. When empty, the dispatcher logs to stderr as slog.Default.
	Log string
	// Delay, when positive, makes the publisher sleep a random time below
	// it before it accepts a batch and again after, honouring its context,
	// to widen the window in which a kill lands mid-publish.
	Delay time.Duration
	// BatchSize is the dispatcher's batch size; 0 means 20.
	BatchSize int
}

func (c helperConfig) env() []string {
	return append(os.Environ(),
		"OUTBOX_HELPER=dispatcher",
		"OUTBOX_HELPER_ENGINE="+string(c.Engine),
		"OUTBOX_HELPER_DSN="+c.DSN,
		"OUTBOX_HELPER_OUT="+c.Out,
		"OUTBOX_HELPER_LEASE="+c.Lease.String(),
		"OUTBOX_HELPER_FAIL_EVERY="+strconv.Itoa(c.FailEvery),
		"OUTBOX_HELPER_LOG="+c.Log,
		"OUTBOX_HELPER_DELAY="+c.Delay.String(),
		"OUTBOX_HELPER_BATCH="+strconv.Itoa(c.BatchSize),
	)
}

// helperPublishMsg is the message of the lines a dispatcher process logs
// when a publish starts (phase "start") and returns (phase "end").
const helperPublishMsg = "helper: publish"

// startDispatcherProcess starts a dispatcher process; it runs until killed
// or interrupted.
func startDispatcherProcess(t *testing.T, c helperConfig) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = c.env()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatalf("start dispatcher process: %v", err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd
}

func runDispatcherProcess() error {
	lease, err := time.ParseDuration(os.Getenv("OUTBOX_HELPER_LEASE"))
	if err != nil {
		return err
	}
	failEvery, _ := strconv.Atoi(os.Getenv("OUTBOX_HELPER_FAIL_EVERY"))
	delay, _ := time.ParseDuration(os.Getenv("OUTBOX_HELPER_DELAY"))
	batchSize, _ := strconv.Atoi(os.Getenv("OUTBOX_HELPER_BATCH"))
	if batchSize <= 0 {
		batchSize = 20
	}
	engine := outboxtest.Engine(os.Getenv("OUTBOX_HELPER_ENGINE"))
	db, err := gorm.Open(outboxtest.Dialector(engine, os.Getenv("OUTBOX_HELPER_DSN")), &gorm.Config{Logger: logger.Discard})
	if err != nil {
		return err
	}
	out, err := os.OpenFile(os.Getenv("OUTBOX_HELPER_OUT"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return err
	}
	pid := os.Getpid()
	log := slog.Default()
	if path := os.Getenv("OUTBOX_HELPER_LOG"); path != "" {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
		if err != nil {
			return err
		}
		// The JSON handler writes each record with one write call, so that
		// records of several processes never interleave.
		log = slog.New(slog.NewJSONHandler(f, &slog.HandlerOptions{Level: slog.LevelInfo})).With("pid", pid)
	}
	// sleep waits up to delay, or until ctx ends; it reports whether ctx
	// is still alive.
	sleep := func(ctx context.Context) bool {
		if delay <= 0 {
			return ctx.Err() == nil
		}
		select {
		case <-time.After(rand.N(delay)):
			return true
		case <-ctx.Done():
			return false
		}
	}
	var (
		mu      sync.Mutex
		batches int
	)
	pub := outbox.PublisherFunc(func(ctx context.Context, b outbox.Batch) error {
		mu.Lock()
		defer mu.Unlock()
		log.Info(helperPublishMsg, "phase", "start", "batch_id", b.ID, "messages", len(b.Messages))
		defer log.Info(helperPublishMsg, "phase", "end", "batch_id", b.ID)
		batches++
		if failEvery > 0 && batches%failEvery == 0 {
			return fmt.Errorf("transient failure of batch %d", batches)
		}
		if !sleep(ctx) {
			return ctx.Err()
		}
		var lines []byte
		for _, m := range b.Messages {
			a := acceptance{EventID: m.EventID, Type: m.EventType, Aggregate: m.AggregateType + "/" + m.AggregateID,
				Sequence: m.Sequence, PID: pid, Batch: b.ID, Attempt: m.Attempt, Visible: true}
			if m.AggregateType == "order" {
				var n int64
				if err := db.WithContext(ctx).Raw(`SELECT count(*) FROM orders WHERE id = ?`, m.AggregateID).Scan(&n).Error; err != nil {
					return err
				}
				a.Visible = n == 1
			}
			line, _ := json.Marshal(a)
			lines = append(append(lines, line...), '\n')
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		// The whole batch is accepted with one write with O_APPEND: lines of
		// several processes never interleave, and a kill lands before or
		// after the write, never inside it.
		if _, err := out.Write(lines); err != nil {
			return err
		}
		sleep(ctx)
		return nil
	})
	d, err := outbox.NewDispatcher(db, pub, outbox.WithLogger(log),
		outbox.WithLease(lease), outbox.WithPublishTimeout(lease/2), outbox.WithBatchSize(batchSize),
		outbox.WithPollInterval(20*time.Millisecond), outbox.WithMaxAttempts(1000),
		outbox.WithRetryPolicy(outbox.RetryPolicyFunc(func(int, error) time.Duration { return 50 * time.Millisecond })))
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	return d.Run(ctx)
}

// readAcceptances reads every line the dispatcher processes wrote to path.
func readAcceptances(t *testing.T, path string) []acceptance {
	t.Helper()
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil
	}
	mustNil(t, err)
	defer f.Close()
	var as []acceptance
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var a acceptance
		if err := json.Unmarshal(sc.Bytes(), &a); err != nil {
			// A process killed mid-write can leave a torn last line; its
			// publish did not return, so the batch counts as not accepted.
			continue
		}
		as = append(as, a)
	}
	mustNil(t, sc.Err())
	return as
}

// checkAcceptances verifies the promises over what dispatcher processes
// accepted: every committed event at least once, per aggregate first
// acceptances in sequence order, no event before its business row was
// visible. It returns how many acceptances were redeliveries.
func checkAcceptances(t *testing.T, as []acceptance, committed map[string]bool) (redeliveries int) {
	t.Helper()
	seen := map[string]bool{}
	next := map[string]int64{}
	for _, a := range as {
		if !a.Visible {
			t.Errorf("event %s (%s #%d) accepted before its business row was visible", a.EventID, a.Aggregate, a.Sequence)
		}
		if !committed[a.EventID] {
			t.Errorf("event %s (%s #%d) accepted, but its transaction did not commit", a.EventID, a.Aggregate, a.Sequence)
		}
		if seen[a.EventID] {
			redeliveries++
			continue
		}
		seen[a.EventID] = true
		if want := next[a.Aggregate] + 1; a.Sequence != want {
			t.Errorf("%s: first acceptance of sequence %d when %d was due", a.Aggregate, a.Sequence, want)
		}
		next[a.Aggregate] = a.Sequence
	}
	for id := range committed {
		if !seen[id] {
			t.Errorf("committed event %s was never accepted", id)
		}
	}
	return redeliveries
}

// helperLogLine is one line of a dispatcher process's log file (see
// helperConfig.Log): a dispatcher log record or a publish marker.
type helperLogLine struct {
	Msg     string `json:"msg"`
	Level   string `json:"level"`
	PID     int    `json:"pid"`
	BatchID string `json:"batch_id"`
	Phase   string `json:"phase"`
	Error   string `json:"error"`
}

// readHelperLog reads the log file dispatcher processes append to.
func readHelperLog(t *testing.T, path string) []helperLogLine {
	t.Helper()
	data, err := os.ReadFile(path)
	if os.IsNotExist(err) {
		return nil
	}
	mustNil(t, err)
	var ls []helperLogLine
	for _, raw := range strings.Split(string(data), "\n") {
		var l helperLogLine
		if raw != "" && json.Unmarshal([]byte(raw), &l) == nil {
			ls = append(ls, l)
		}
	}
	return ls
}

// timedOutBatches returns the batches whose lease the dispatcher reports
// as run out before their settle took effect: the settle found the rows
// claimed by another batch, the settle itself failed (the rows stay
// delivering until their lease passes), or the publisher was abandoned at
// its deadline. Those batches are redelivered by design.
func timedOutBatches(lines []helperLogLine) map[string]string {
	out := map[string]string{}
	for _, l := range lines {
		switch {
		case strings.Contains(l.Msg, "lease lost before settle"):
			out[l.BatchID] = "lease lost before settle"
		case strings.Contains(l.Msg, "ignored its deadline"):
			out[l.BatchID] = "publish abandoned at its deadline"
		case strings.Contains(l.Error, "settle batch "):
			id, _, _ := strings.Cut(strings.SplitN(l.Error, "settle batch ", 2)[1], ":")
			out[id] = "settle failed: " + l.Error
		}
	}
	return out
}
