package outbox_test

import (
	"encoding/json"
	"errors"
	"strconv"
	"testing"

	"gorm.io/gorm"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// bundle is what a test gets from setup: a migrated database with the
// plugin registered.
type bundle struct {
	db     *gorm.DB
	info   outboxtest.DB
	plugin *outbox.OutboxPlugin
}

// setup opens a fresh database on engine e, registers the plugin with opts,
// and migrates the outbox and the test models.
func setup(t *testing.T, e outboxtest.Engine, cfg *gorm.Config, opts ...outbox.Option) bundle {
	t.Helper()
	db, info := outboxtest.Open(t, e, cfg)
	p := outbox.Plugin(append([]outbox.Option{outbox.WithPluginLogger(outboxtest.Logger(t))}, opts...)...)
	if err := db.Use(p); err != nil {
		t.Fatalf("db.Use: %v", err)
	}
	if err := outbox.AutoMigrate(db); err != nil {
		t.Fatalf("outbox.AutoMigrate: %v", err)
	}
	if err := db.AutoMigrate(&Order{}, &Widget{}, &Note{}, &Broken{}, &Foreign{}); err != nil {
		t.Fatalf("db.AutoMigrate: %v", err)
	}
	return bundle{db: db, info: info, plugin: p}
}

// records returns the rows of the bundle's outbox table.
func (b bundle) records(t *testing.T) []outboxtest.Record {
	t.Helper()
	return outboxtest.Records(t, b.db, b.plugin.Table())
}

// Order emits one event per write, with itself as payload.
type Order struct {
	ID     uint
	Status string
	Total  int
}

func (o *Order) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return []outbox.Event{{
		Type:          "order." + string(op),
		AggregateType: "order",
		AggregateID:   strconv.Itoa(int(o.ID)),
		Payload:       o,
	}}, nil
}

// Widget emits nothing.
type Widget struct {
	ID   uint
	Name string
}

// Note emits through a value receiver.
type Note struct {
	ID   uint
	Text string
}

func (n Note) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return []outbox.Event{{Type: "note." + string(op), AggregateType: "note", AggregateID: strconv.Itoa(int(n.ID)), Payload: map[string]string{"text": n.Text}}}, nil
}

// Broken emits the bad event its Mode names.
type Broken struct {
	ID   uint
	Mode string
}

type cyclic struct{ Next *cyclic }

var errEmitter = errors.New("emitter refused")

func (b *Broken) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	ok := outbox.Event{Type: "broken." + string(op), AggregateType: "broken", AggregateID: strconv.Itoa(int(b.ID)), Payload: b}
	ev := ok
	switch b.Mode {
	case "ok":
	case "no-type":
		ev.Type = ""
	case "no-aggregate-type":
		ev.AggregateType = ""
	case "no-aggregate-id":
		ev.AggregateID = ""
	case "channel":
		ev.Payload = make(chan int)
	case "function":
		ev.Payload = func() {}
	case "cycle":
		c := &cyclic{}
		c.Next = c
		ev.Payload = c
	case "raw-invalid":
		ev.Payload = json.RawMessage(`{"open":`)
	case "bytes-invalid":
		ev.Payload = []byte("not json")
	case "raw-empty":
		ev.Payload = json.RawMessage(nil)
	case "panic":
		panic("emitter panicked")
	case "error":
		return nil, errEmitter
	}
	// The valid event first: a bad second event must still write nothing.
	return []outbox.Event{ok, ev}, nil
}

// Foreign stands for a type from another package, given events through
// RegisterEmitter.
type Foreign struct {
	ID   uint
	Name string
}
