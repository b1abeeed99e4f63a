package outbox_test

import (
	"errors"
	"slices"
	"strconv"
	"strings"
	"testing"

	"gorm.io/gorm"
	"gorm.io/gorm/clause"
	"gorm.io/gorm/schema"

	"github.com/gorm-outbox/outbox"
	"github.com/gorm-outbox/outbox/internal/outboxtest"
)

// Cart has Items, whose table has a unique key besides its primary key:
// GORM saves them as an upsert, which on MySQL fires on either key.
type Cart struct {
	ID    uint
	Name  string
	Items []CartItem
}

func (c *Cart) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("cart", op, c.ID, map[string]any{"ID": c.ID, "Name": c.Name}), nil
}

type CartItem struct {
	ID     uint
	CartID uint   `gorm:"uniqueIndex:cart_items_cart_sku"`
	Sku    string `gorm:"size:64;uniqueIndex:cart_items_cart_sku"`
	Qty    int
}

func (i *CartItem) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("item", op, i.ID, i), nil
}

// Label has a unique code besides its primary key.
type Label struct {
	ID   uint
	Code string `gorm:"size:64;uniqueIndex"`
	Name string
}

func (l *Label) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("label", op, l.ID, l), nil
}

// Voucher has Lines keyed by the voucher's id and a SKU, as GORM's own
// CouponProduct is: GORM's upsert of a line assigns its voucher_id, part
// of its primary key.
type Voucher struct {
	ID    uint
	Name  string
	Lines []VoucherLine
}

func (v *Voucher) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("voucher", op, v.ID, map[string]any{"ID": v.ID, "Name": v.Name}), nil
}

type VoucherLine struct {
	VoucherID uint   `gorm:"primaryKey;autoIncrement:false"`
	Sku       string `gorm:"primaryKey;size:64"`
	Qty       int
}

func (l *VoucherLine) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return []outbox.Event{{Type: "line." + string(op), AggregateType: "line",
		AggregateID: strconv.Itoa(int(l.VoucherID)) + "/" + l.Sku, Payload: l}}, nil
}

// Tag has a unique code that may be NULL: NULLs clash with nothing.
type Tag struct {
	ID   uint
	Code *string `gorm:"size:64;uniqueIndex"`
	Name string
}

func (g *Tag) OutboxEvents(op outbox.Op) ([]outbox.Event, error) {
	return rowEvent("tag", op, g.ID, g), nil
}

func setupUpserts(t *testing.T, e outboxtest.Engine) bundle {
	t.Helper()
	b := setup(t, e, nil)
	mustNil(t, b.db.AutoMigrate(&Cart{}, &CartItem{}, &Label{}, &Tag{}, &Voucher{}, &VoucherLine{}))
	return b
}

// upsertOnCode upserts labels on their code, setting the name.
var upsertOnCode = clause.OnConflict{Columns: []clause.Column{{Name: "code"}}, DoUpdates: clause.AssignmentColumns([]string{"name"})}

// TestUpsertsRecordWhatEachRowDid: an upsert records a create for each
// row it inserted and an update for each row it updated, with the row as
// stored, on tables with several unique keys too, and when one statement
// names one key twice. On MySQL, a row the upsert left as it was (the
// server wrote nothing) records nothing; PostgreSQL and SQLite write such
// a row again, and record the update.
func TestUpsertsRecordWhatEachRowDid(t *testing.T) {
	cases := []struct {
		name string
		run  func(t *testing.T, db *gorm.DB) error
		want []string
		// per engine where it differs from want; an error means the
		// engine refuses the statement and it writes nothing.
		mysql, postgres []string
		postgresErr     bool
	}{
		{"CreateParentWithChildrenUnderASecondUniqueKey", func(t *testing.T, db *gorm.DB) error {
			return db.Create(&Cart{Name: "c", Items: []CartItem{{Sku: "a", Qty: 1}, {Sku: "b", Qty: 2}}}).Error
		}, []string{
			`item.create item/1#1 {"CartID":1,"ID":1,"Qty":1,"Sku":"a"}`,
			`item.create item/2#1 {"CartID":1,"ID":2,"Qty":2,"Sku":"b"}`,
			`cart.create cart/1#1 {"ID":1,"Name":"c"}`,
		}, nil, nil, false},
		{"SaveParentWithNewAndResavedChildren", func(t *testing.T, db *gorm.DB) error {
			c := Cart{Name: "c", Items: []CartItem{{Sku: "a", Qty: 1}}}
			if err := outbox.WithoutEvents(db).Create(&c).Error; err != nil {
				return err
			}
			c.Name = "d"
			c.Items = append(c.Items, CartItem{Sku: "b", Qty: 2})
			return db.Save(&c).Error
		}, []string{
			`item.update item/1#1 {"CartID":1,"ID":1,"Qty":1,"Sku":"a"}`,
			`item.create item/2#1 {"CartID":1,"ID":2,"Qty":2,"Sku":"b"}`,
			`cart.update cart/1#1 {"ID":1,"Name":"d"}`,
		}, []string{
			// GORM's upsert sets the item's cart_id to what it holds:
			// MySQL writes nothing.
			`item.create item/2#1 {"CartID":1,"ID":2,"Qty":2,"Sku":"b"}`,
			`cart.update cart/1#1 {"ID":1,"Name":"d"}`,
		}, nil, false},
		{"UpsertOnTheSecondUniqueKey", func(t *testing.T, db *gorm.DB) error {
			if err := db.Create(&Label{Code: "x", Name: "old"}).Error; err != nil {
				return err
			}
			return db.Clauses(upsertOnCode).Create(&[]Label{{Code: "x", Name: "new"}, {Code: "y", Name: "why"}}).Error
		}, []string{
			`label.create label/1#1 {"Code":"x","ID":1,"Name":"old"}`,
			`label.update label/1#2 {"Code":"x","ID":1,"Name":"new"}`,
			`label.create label/3#1 {"Code":"y","ID":3,"Name":"why"}`,
		}, []string{
			// PostgreSQL and SQLite take a key for the row they updated;
			// InnoDB does not.
			`label.create label/1#1 {"Code":"x","ID":1,"Name":"old"}`,
			`label.update label/1#2 {"Code":"x","ID":1,"Name":"new"}`,
			`label.create label/2#1 {"Code":"y","ID":2,"Name":"why"}`,
		}, nil, false},
		{"UpsertThatNamesOneKeyTwice", func(t *testing.T, db *gorm.DB) error {
			return db.Clauses(upsertOnCode).Create(&[]Label{{Code: "dup", Name: "first"}, {Code: "dup", Name: "second"}}).Error
		}, []string{
			`label.create label/1#1 {"Code":"dup","ID":1,"Name":"first"}`,
			`label.update label/1#2 {"Code":"dup","ID":1,"Name":"second"}`,
		}, nil, nil, true}, // PostgreSQL: "cannot affect row a second time"
		{"SaveOfChildrenKeyedByTheirParent", func(t *testing.T, db *gorm.DB) error {
			v := Voucher{Name: "v", Lines: []VoucherLine{{Sku: "a", Qty: 1}, {Sku: "b", Qty: 2}}}
			if err := outbox.WithoutEvents(db).Create(&v).Error; err != nil {
				return err
			}
			v.Name = "w"
			v.Lines[1].Qty = 3 // in memory only: the upsert sets voucher_id alone
			v.Lines = append(v.Lines, VoucherLine{Sku: "c", Qty: 4})
			return db.Save(&v).Error
		}, []string{
			`line.update line/1/a#1 {"Qty":1,"Sku":"a","VoucherID":1}`,
			`line.update line/1/b#1 {"Qty":2,"Sku":"b","VoucherID":1}`,
			`line.create line/1/c#1 {"Qty":4,"Sku":"c","VoucherID":1}`,
			`voucher.update voucher/1#1 {"ID":1,"Name":"w"}`,
		}, []string{
			// The upsert sets each line's voucher_id to what it holds:
			// MySQL writes nothing.
			`line.create line/1/c#1 {"Qty":4,"Sku":"c","VoucherID":1}`,
			`voucher.update voucher/1#1 {"ID":1,"Name":"w"}`,
		}, nil, false},
		{"UpsertOfRowsWhoseKeyIsNULL", func(t *testing.T, db *gorm.DB) error {
			return db.Clauses(upsertOnCode).Create(&[]Tag{{Name: "first"}, {Name: "second"}}).Error
		}, []string{
			`tag.create tag/1#1 {"Code":null,"ID":1,"Name":"first"}`,
			`tag.create tag/2#1 {"Code":null,"ID":2,"Name":"second"}`,
		}, nil, nil, false},
		{"UpsertThatChangesNothing", func(t *testing.T, db *gorm.DB) error {
			if err := db.Create(&Label{Code: "x", Name: "same"}).Error; err != nil {
				return err
			}
			return db.Clauses(upsertOnCode).Create(&Label{Code: "x", Name: "same"}).Error
		}, []string{
			`label.create label/1#1 {"Code":"x","ID":1,"Name":"same"}`,
			`label.update label/1#2 {"Code":"x","ID":1,"Name":"same"}`,
		}, []string{
			`label.create label/1#1 {"Code":"x","ID":1,"Name":"same"}`,
		}, nil, false},
		{"UpsertThatChangesOneRowOfTwo", func(t *testing.T, db *gorm.DB) error {
			if err := db.Create(&[]Label{{Code: "x", Name: "same"}, {Code: "y", Name: "old"}}).Error; err != nil {
				return err
			}
			return db.Clauses(upsertOnCode).Create(&[]Label{{Code: "x", Name: "same"}, {Code: "y", Name: "new"}}).Error
		}, []string{
			`label.create label/1#1 {"Code":"x","ID":1,"Name":"same"}`,
			`label.create label/2#1 {"Code":"y","ID":2,"Name":"old"}`,
			`label.update label/1#2 {"Code":"x","ID":1,"Name":"same"}`,
			`label.update label/2#2 {"Code":"y","ID":2,"Name":"new"}`,
		}, []string{
			`label.create label/1#1 {"Code":"x","ID":1,"Name":"same"}`,
			`label.create label/2#1 {"Code":"y","ID":2,"Name":"old"}`,
			`label.update label/2#2 {"Code":"y","ID":2,"Name":"new"}`,
		}, nil, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
				b := setupUpserts(t, e)
				want := c.want
				switch {
				case e == outboxtest.MySQL && c.mysql != nil:
					want = c.mysql
				case e == outboxtest.Postgres && c.postgres != nil:
					want = c.postgres
				}
				var err error
				txErr := b.db.Transaction(func(tx *gorm.DB) error {
					err = c.run(t, tx)
					return nil // what a failed upsert wrote must be gone even so
				})
				if e == outboxtest.Postgres && c.postgresErr {
					if err == nil || txErr == nil {
						t.Fatalf("PostgreSQL took the statement (%v) or committed after it (%v)", err, txErr)
					}
					want = nil
				} else {
					mustNil(t, err)
					mustNil(t, txErr)
				}
				if got := styleEvents(t, b, 0); strings.Join(got, "\n") != strings.Join(want, "\n") {
					t.Fatalf("events:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
				}
				assertLastEventsMatchLabels(t, b)
			})
		})
	}
}

// assertLastEventsMatchLabels checks that the last event of each label
// holds the row the table holds, and that every label has one.
func assertLastEventsMatchLabels(t *testing.T, b bundle) {
	t.Helper()
	var labels []Label
	mustNil(t, b.db.Order("id").Find(&labels).Error)
	last := map[string]string{}
	for _, r := range b.records(t) {
		if r.AggregateType == "label" {
			last[r.AggregateID] = r.Payload
		}
	}
	if len(last) != len(labels) {
		t.Errorf("%d labels have events, %d exist", len(last), len(labels))
	}
	for _, l := range labels {
		p, ok := last[strconv.Itoa(int(l.ID))]
		if !ok {
			t.Errorf("label %d exists without an event", l.ID)
			continue
		}
		assertJSON(t, p, `{"ID":`+strconv.Itoa(int(l.ID))+`,"Code":"`+l.Code+`","Name":"`+l.Name+`"}`)
	}
}

// TestMySQLUpsertItCannotIdentifyIsRefusedBeforeWriting: an upsert that
// assigns the primary key changes the key by which the plugin tells the
// rows apart, a unique key on a prefix of a column clashes where the
// values differ, and a table of which the server reports no unique key
// at all (an InnoDB table has a primary key: the plugin would be looking
// at another table than the one written) leaves the plugin nothing to
// read; each is refused, saying why and how to write it otherwise, and
// nothing is written.
func TestMySQLUpsertItCannotIdentifyIsRefusedBeforeWriting(t *testing.T) {
	for _, c := range []struct {
		name, ddl, says string
		upsert          clause.OnConflict
	}{
		{"AssignsThePrimaryKey", "", "primary key", clause.OnConflict{DoUpdates: clause.AssignmentColumns([]string{"id", "name"})}},
		{"UniqueKeyOnAPrefix", "CREATE UNIQUE INDEX labels_name_prefix ON labels (name(4))", "name(4)", upsertOnCode},
		{"NoUniqueKey", "ALTER TABLE labels DROP INDEX idx_labels_code, DROP PRIMARY KEY, ADD KEY labels_id (id)", "no unique key", upsertOnCode},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setupUpserts(t, outboxtest.MySQL)
			if c.ddl != "" {
				mustNil(t, b.db.Exec(c.ddl).Error)
			}
			mustNil(t, b.db.Create(&Label{Code: "x", Name: "old"}).Error)
			err := b.db.Clauses(c.upsert).Create(&[]Label{{ID: 7, Code: "x", Name: "new"}, {ID: 8, Code: "z", Name: "zed"}}).Error
			if !errors.Is(err, outbox.ErrUnidentifiedRows) || !strings.Contains(err.Error(), c.says) || !strings.Contains(err.Error(), "Omit(clause.Associations)") {
				t.Fatalf("err = %v, want ErrUnidentifiedRows naming %s and saying how to write it otherwise", err, c.says)
			}
			var labels []Label
			mustNil(t, b.db.Order("id").Find(&labels).Error)
			if len(labels) != 1 || labels[0].Name != "old" || len(b.records(t)) != 1 {
				t.Fatalf("the refused upsert wrote: labels %+v, %d outbox rows", labels, len(b.records(t)))
			}
		})
	}
}

// TestMySQLWritesToATableInAnotherDatabaseRecordWhatTheyDid: a model's
// table named with a database before it (otherdb.labels: from a naming
// strategy's TablePrefix as from a model's TableName, or given with
// Table) is where the plugin reads the table's unique keys and the rows
// a write changes, so that an upsert records an update for a row it
// updated and a create for one it inserted, and updates by condition,
// limited ones too, record what they wrote.
func TestMySQLWritesToATableInAnotherDatabaseRecordWhatTheyDid(t *testing.T) {
	for _, c := range []struct {
		name string
		// on returns the session that writes labels to other.labels.
		on func(t *testing.T, b bundle, other string) *gorm.DB
	}{
		{"ModelsTableName", func(t *testing.T, b bundle, other string) *gorm.DB {
			db := outboxtest.Reopen(t, b.info, &gorm.Config{NamingStrategy: schema.NamingStrategy{TablePrefix: other + "."}})
			mustNil(t, db.Use(outbox.Plugin(outbox.WithPluginLogger(outboxtest.Logger(t)))))
			return db
		}},
		{"Table", func(t *testing.T, b bundle, other string) *gorm.DB {
			return b.db.Table(other + ".labels").Session(&gorm.Session{})
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			b := setup(t, outboxtest.MySQL, nil)
			other := otherDatabase(t, b.db)
			mustNil(t, b.db.Exec("CREATE TABLE "+other+".labels (id bigint unsigned AUTO_INCREMENT PRIMARY KEY, code varchar(64), name longtext, UNIQUE KEY labels_code (code))").Error)
			db := c.on(t, b, other)
			mustNil(t, db.Create(&Label{Code: "x", Name: "old"}).Error)
			mustNil(t, db.Clauses(upsertOnCode).Create(&[]Label{{Code: "x", Name: "new"}, {Code: "y", Name: "why"}}).Error)
			mustNil(t, db.Model(&Label{}).Where("code = ?", "y").Update("name", "why not").Error)
			mustNil(t, db.Model(&Label{}).Where("code = ?", "x").Limit(1).Update("name", "newer").Error)
			want := []string{
				`label.create label/1#1 {"Code":"x","ID":1,"Name":"old"}`,
				`label.update label/1#2 {"Code":"x","ID":1,"Name":"new"}`,
				`label.create label/2#1 {"Code":"y","ID":2,"Name":"why"}`,
				`label.update label/2#2 {"Code":"y","ID":2,"Name":"why not"}`,
				`label.update label/1#3 {"Code":"x","ID":1,"Name":"newer"}`,
			}
			if got := styleEvents(t, b, 0); !slices.Equal(got, want) {
				t.Fatalf("events\n%s\nwant\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
			}
			var labels []Label
			mustNil(t, db.Order("id").Find(&labels).Error)
			if len(labels) != 2 || labels[0].Name != "newer" || labels[1].Name != "why not" {
				t.Fatalf("%s.labels holds %+v", other, labels)
			}
		})
	}
}

// otherDatabase creates, on db's MySQL server, a database beside db's
// own, named after it, and drops it when t ends.
func otherDatabase(t *testing.T, db *gorm.DB) string {
	t.Helper()
	var own string
	mustNil(t, db.Raw("SELECT DATABASE()").Scan(&own).Error)
	other := own + "_other"
	mustNil(t, db.Exec("CREATE DATABASE "+other).Error)
	t.Cleanup(func() {
		if err := db.Exec("DROP DATABASE " + other).Error; err != nil {
			t.Errorf("drop database %s: %v", other, err)
		}
	})
	return other
}

// TestParentAndChildrenWrittenApartRecordEveryRow: the way around a
// refused upsert of children that the errors and docs/mysql.md give
// (the parent with Omit(clause.Associations), then the children in a
// second Create) records every row on every engine, and on MySQL 8,
// which refuses the children's upsert.
func TestParentAndChildrenWrittenApartRecordEveryRow(t *testing.T) {
	write := func(t *testing.T, b bundle) {
		c := Cart{Name: "c", Items: []CartItem{{Sku: "a", Qty: 1}, {Sku: "b", Qty: 2}}}
		mustNil(t, b.db.Transaction(func(tx *gorm.DB) error {
			if err := tx.Omit(clause.Associations).Create(&c).Error; err != nil {
				return err
			}
			for i := range c.Items {
				c.Items[i].CartID = c.ID
			}
			return tx.Create(&c.Items).Error
		}))
		// On MySQL 8 the refused create took cart 1's auto-increment value.
		cart := strconv.Itoa(int(c.ID))
		want := []string{
			`cart.create cart/` + cart + `#1 {"ID":` + cart + `,"Name":"c"}`,
			`item.create item/1#1 {"CartID":` + cart + `,"ID":1,"Qty":1,"Sku":"a"}`,
			`item.create item/2#1 {"CartID":` + cart + `,"ID":2,"Qty":2,"Sku":"b"}`,
		}
		if got := styleEvents(t, b, 0); strings.Join(got, "\n") != strings.Join(want, "\n") {
			t.Fatalf("events:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
		}
	}
	outboxtest.ForEachEngine(t, func(t *testing.T, e outboxtest.Engine) {
		write(t, setupUpserts(t, e))
	})
	t.Run("MySQL8", func(t *testing.T) {
		t.Parallel()
		b := setupMySQL8(t)
		mustNil(t, b.db.AutoMigrate(&Cart{}, &CartItem{}))
		err := b.db.Create(&Cart{Name: "c", Items: []CartItem{{Sku: "a", Qty: 1}}}).Error
		if !errors.Is(err, outbox.ErrUnidentifiedRows) || !strings.Contains(err.Error(), "Omit(clause.Associations)") {
			t.Fatalf("err = %v, want ErrUnidentifiedRows saying how to write it otherwise", err)
		}
		var n int64
		mustNil(t, b.db.Model(&Cart{}).Count(&n).Error)
		if n != 0 || len(b.records(t)) != 0 {
			t.Fatalf("the refused create left %d carts and %d outbox rows", n, len(b.records(t)))
		}
		write(t, b)
	})
}
