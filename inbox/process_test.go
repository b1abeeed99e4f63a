package inbox_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/inbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
	"github.com/gorm-outbox/outbox/outboxhttp"
)

// The test binary doubles as a consumer process and as a dispatcher
// process: tests start copies of it with INBOX_HELPER set, and kill them.
func TestMain(m *testing.M) {
	var err error
	switch os.Getenv("INBOX_HELPER") {
	case "":
		os.Exit(m.Run())
	case "consumer":
		err = runConsumerProcess()
	case "dispatcher":
		err = runDispatcherProcess()
	default:
		err = fmt.Errorf("unknown INBOX_HELPER %q", os.Getenv("INBOX_HELPER"))
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, os.Getenv("INBOX_HELPER"), "process:", err)
		os.Exit(1)
	}
	os.Exit(0)
}

// helperCommand returns a command that runs the test binary as the helper
// named role, with the database info names and the extra environment.
func helperCommand(role string, info outboxtest.DB, extra ...string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(),
		"INBOX_HELPER="+role,
		"INBOX_HELPER_ENGINE="+string(info.Engine),
		"INBOX_HELPER_DSN="+info.DSN,
	)
	cmd.Env = append(cmd.Env, extra...)
	cmd.Stderr = os.Stderr
	return cmd
}

func helperDB() (*gorm.DB, error) {
	e := outboxtest.Engine(os.Getenv("INBOX_HELPER_ENGINE"))
	return gorm.Open(outboxtest.Dialector(e, os.Getenv("INBOX_HELPER_DSN")), &gorm.Config{Logger: logger.Discard})
}

// consumerInside is the line a consumer process prints once its fn has
// written its shipment, before it hangs (INBOX_HELPER_HANG=1).
const consumerInside = "inside fn"

// runConsumerProcess delivers message INBOX_HELPER_ID once and prints
// "handled=<bool>"; with INBOX_HELPER_HANG=1 its fn hangs after writing,
// for the test to kill the process there.
func runConsumerProcess() error {
	db, err := helperDB()
	if err != nil {
		return err
	}
	in, err := inbox.New(db)
	if err != nil {
		return err
	}
	id := os.Getenv("INBOX_HELPER_ID")
	handled, err := in.Handle(context.Background(), id, func(tx *gorm.DB) error {
		if err := ship(id)(tx); err != nil {
			return err
		}
		if os.Getenv("INBOX_HELPER_HANG") == "1" {
			fmt.Println(consumerInside)
			select {}
		}
		return nil
	})
	if err != nil {
		return err
	}
	fmt.Printf("handled=%v\n", handled)
	return nil
}

func TestConsumerKilledInsideHandlerAppliesOnceAfterRestart(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		db, in, info := newConsumer(t, e)
		const id = "evt-killed"

		cmd := helperCommand("consumer", info, "INBOX_HELPER_ID="+id, "INBOX_HELPER_HANG=1")
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
		inside := make(chan error, 1)
		go func() {
			line, err := bufio.NewReader(stdout).ReadString('\n')
			if err == nil && strings.TrimSpace(line) != consumerInside {
				err = fmt.Errorf("consumer printed %q", line)
			}
			inside <- err
		}()
		select {
		case err := <-inside:
			if err != nil {
				t.Fatalf("consumer process: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Fatal("the consumer process never reached fn")
		}
		if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
			t.Fatal(err)
		}
		_ = cmd.Wait()

		if rows := inboxRows(t, db, inbox.DefaultTable); len(rows) != 0 {
			t.Errorf("inbox holds %v after the kill, want nothing", rows)
		}
		if got := shipments(t, db); len(got) != 0 {
			t.Errorf("shipments %v after the kill, want none", got)
		}

		// The restarted consumer applies it; any later delivery skips it.
		out, err := helperCommand("consumer", info, "INBOX_HELPER_ID="+id).Output()
		if err != nil || strings.TrimSpace(string(out)) != "handled=true" {
			t.Fatalf("restarted consumer: %q, %v; want handled=true", out, err)
		}
		if handled, err := in.Handle(context.Background(), id, ship(id)); handled || err != nil {
			t.Errorf("delivery after the restart: %v, %v; want false, nil", handled, err)
		}
		checkAppliedOnce(t, db, id)
	})
}

// Order is the producer's model in the end-to-end test: every write
// records an event of aggregate order/<ID>.
type Order struct {
	ID     uint
	Amount int
}

func (o *Order) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return []outbox.Event{{
		Type: "order." + string(op), AggregateType: "order", AggregateID: strconv.Itoa(int(o.ID)), Payload: o,
	}}, nil
}

// runDispatcherProcess dispatches the producer database's outbox to the
// receiver at INBOX_HELPER_URL until it is killed.
func runDispatcherProcess() error {
	db, err := helperDB()
	if err != nil {
		return err
	}
	if err := db.Use(outbox.Plugin()); err != nil {
		return err
	}
	pub, err := outboxhttp.New(os.Getenv("INBOX_HELPER_URL"))
	if err != nil {
		return err
	}
	d, err := outbox.NewDispatcher(db, pub,
		outbox.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))),
		outbox.WithBatchSize(10), outbox.WithLease(800*time.Millisecond), outbox.WithPublishTimeout(600*time.Millisecond),
		outbox.WithPollInterval(20*time.Millisecond), outbox.WithMaxAttempts(1000),
		outbox.WithRetryPolicy(outbox.RetryPolicyFunc(func(int, error) time.Duration { return 50 * time.Millisecond })))
	if err != nil {
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	return d.Run(ctx)
}

// teeWriter keeps a copy of the response body.
type teeWriter struct {
	http.ResponseWriter
	body bytes.Buffer
}

func (w *teeWriter) Write(p []byte) (int, error) {
	w.body.Write(p)
	return w.ResponseWriter.Write(p)
}

func TestEndToEndRedeliveredBatchesApplyOnce(t *testing.T) {
	t.Parallel()
	forEachEngine(t, func(t *testing.T, e engine) {
		producer, producerInfo := openDB(t, e)
		if err := producer.Use(outbox.Plugin()); err != nil {
			t.Fatal(err)
		}
		if err := outbox.AutoMigrate(producer); err != nil {
			t.Fatal(err)
		}
		if err := producer.AutoMigrate(&Order{}); err != nil {
			t.Fatal(err)
		}
		for i := range 12 {
			o := Order{Amount: i}
			if err := producer.Create(&o).Error; err != nil {
				t.Fatal(err)
			}
			for range 2 {
				if err := producer.Model(&o).Update("amount", gorm.Expr("amount + 1")).Error; err != nil {
					t.Fatal(err)
				}
			}
			// A write that rolls back records no event.
			_ = producer.Transaction(func(tx *gorm.DB) error {
				if err := tx.Create(&Order{Amount: -1}).Error; err != nil {
					return err
				}
				return fmt.Errorf("rolled back")
			})
		}
		var committed []string
		if err := producer.Table(outbox.DefaultTable).Order("id").Pluck("event_id", &committed).Error; err != nil {
			t.Fatal(err)
		}
		if len(committed) != 36 {
			t.Fatalf("producer committed %d events, want 36", len(committed))
		}

		consumer, in, _ := newConsumer(t, e)

		// The dispatcher process is killed inside the receiver, while it
		// applies the 5th, 17th and 29th message: batches whose first
		// messages were applied are delivered again once their lease passes.
		var (
			mu         sync.Mutex
			current    *exec.Cmd
			applied    atomic.Int32
			kills      atomic.Int32
			duplicates atomic.Int32
		)
		killAt := map[int32]bool{5: true, 17: true, 29: true}
		apply := func(tx *gorm.DB, m outbox.Message) error {
			if killAt[applied.Add(1)] {
				mu.Lock()
				if current != nil {
					_ = current.Process.Signal(syscall.SIGKILL)
					kills.Add(1)
				}
				mu.Unlock()
			}
			return tx.Create(&Shipment{MessageID: m.EventID, Sequence: m.Sequence}).Error
		}
		receiver := newReceiver(t, in, apply)
		srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			tw := &teeWriter{ResponseWriter: w}
			receiver.ServeHTTP(tw, r)
			var resp inbox.Response
			if json.Unmarshal(tw.body.Bytes(), &resp) == nil {
				for _, res := range resp.Results {
					if res.Outcome == inbox.Duplicate {
						duplicates.Add(1)
					}
				}
			}
		}))
		t.Cleanup(srv.Close)

		// A supervisor restarts the dispatcher process whenever it dies.
		done := make(chan struct{})
		supervised := make(chan struct{})
		go func() {
			defer close(supervised)
			for {
				cmd := helperCommand("dispatcher", producerInfo, "INBOX_HELPER_URL="+srv.URL)
				cmd.Stdout = io.Discard
				mu.Lock()
				select {
				case <-done:
					mu.Unlock()
					return
				default:
				}
				if err := cmd.Start(); err != nil {
					mu.Unlock()
					t.Errorf("start dispatcher process: %v", err)
					return
				}
				current = cmd
				mu.Unlock()
				_ = cmd.Wait()
			}
		}()
		t.Cleanup(func() {
			mu.Lock()
			close(done)
			if current != nil {
				_ = current.Process.Kill()
			}
			mu.Unlock()
			<-supervised
		})

		deadline := time.Now().Add(60 * time.Second)
		for {
			var pending int64
			if err := producer.Table(outbox.DefaultTable).Where("delivery_state <> ?", "delivered").Count(&pending).Error; err != nil {
				t.Fatal(err)
			}
			if pending == 0 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d events still undelivered after 60s", pending)
			}
			time.Sleep(20 * time.Millisecond)
		}

		if n := kills.Load(); n != 3 {
			t.Errorf("the dispatcher process was killed %d times, want 3", n)
		}
		if duplicates.Load() == 0 {
			t.Error("no message was delivered twice: the kills did not exercise the inbox")
		}
		checkAppliedOnce(t, consumer, committed...)
		// Each order's events were applied in its sequence order.
		var rows []Shipment
		if err := consumer.Order("id").Find(&rows).Error; err != nil {
			t.Fatal(err)
		}
		var events []struct {
			EventID     string
			AggregateID string
		}
		if err := producer.Table(outbox.DefaultTable).Select("event_id, aggregate_id").Scan(&events).Error; err != nil {
			t.Fatal(err)
		}
		aggregateOf := make(map[string]string, len(events))
		for _, ev := range events {
			aggregateOf[ev.EventID] = ev.AggregateID
		}
		next := map[string]int64{}
		for _, r := range rows {
			agg := aggregateOf[r.MessageID]
			if want := next[agg] + 1; r.Sequence != want {
				t.Errorf("order %s: sequence %d applied when %d was due", agg, r.Sequence, want)
			}
			next[agg] = r.Sequence
		}
	})
}
