;;;; The PostgreSQL channel bus: what PUBLISH sends in one process reaches
;;;; the subscribers of every process and machine that uses the database,
;;;; through LISTEN/NOTIFY on one PostgreSQL channel, +BUS-CHANNEL+.
;;;;
;;;; A publish never waits on the database: it queues the message (at most
;;;; +BUS-QUEUE-LIMIT+; past them it is dropped and counted), and the
;;;; bus's publisher thread sends the queue in order on a connection of its
;;;; pool (connection-pool.lisp), so messages from one process arrive in
;;;; the order published.  A payload over NOTIFY's 8,000 bytes goes through
;;;; the table hunchentoot_channel_messages, the notification naming its
;;;; row.  The listener thread holds a connection of its own, LISTENing,
;;;; and delivers each notification of another process here
;;;; (DELIVER-PUBLISHED); one of its own origin was delivered when it was
;;;; published.
;;;;
;;;; Delivery across processes is at most once.  While the database is
;;;; unreachable, local delivery goes on; messages published meanwhile are
;;;; dropped and counted, the outage is logged once, and both threads
;;;; reconnect, at most once a second.  Each message carries its origin's
;;;; sequence number, so that a listener counts what it missed from each
;;;; other process.
;;;;
;;;; LOCK guards QUEUE and the counters the two threads share.

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *bus-channel* "hunchentoot_channels"
  "The PostgreSQL channel every process LISTENs on and NOTIFYs.")

(defconstant +bus-queue-limit+ 10000
  "The most messages a process keeps waiting for the database.")

(defconstant +notify-payload-octets+ 7900
  "The largest payload sent in the notification itself: NOTIFY takes under
8,000 bytes.")

(defconstant +bus-reconnect-seconds+ 1
  "The least time between two attempts of a thread of the bus to reach
the database once it failed.")

(defclass postgresql-channel-bus ()
  ((description :initarg :description :reader bus-description
                :documentation "Where the database is, for log lines.")
   (connect :initarg :connect :reader bus-connect
            :documentation "A function returning a new connection, the bus's tables made.")
   (pool :initarg :pool :reader bus-pool
         :documentation "The DATABASE-POOL the publisher sends on.")
   (origin :initform (format nil "~36R" (random (expt 2 64) (make-random-state t))) :reader bus-origin
           :documentation "This process's name on the bus, in every payload it sends.")
   (lock :initform (bt:make-lock "channel bus") :reader bus-lock)
   (queued :initform (bt:make-condition-variable :name "channel bus queue") :reader bus-queued)
   (queue :initform (make-array 64 :adjustable t :fill-pointer 0) :accessor bus-queue
          :documentation "Encoded payloads waiting for the publisher, oldest first.")
   (sequence :initform 0 :accessor bus-sequence
             :documentation "The number of the last message this process published.")
   (last-seen :initform (make-hash-table :test 'equal) :reader bus-last-seen
              :documentation "Origin -> the sequence number last received from it (the listener's).")
   (stopping-p :initform nil :accessor bus-stopping-p)
   (outage-logged-p :initform nil :accessor bus-outage-logged-p
                    :documentation "True from the first failure of an outage, logged, to the next success.")
   (threads :initform '() :accessor bus-threads)
   (counts :initform (list :bus-messages-out 0 :bus-messages-in 0 :bus-messages-dropped 0
                           :bus-messages-missed 0 :bus-reconnects 0)
           :accessor bus-counts
           :documentation "What BUS-STATISTICS reports: messages sent, received from other
processes, dropped unsent, missed (numbers skipped in another's sequence),
and connections made again after a failure."))
  (:documentation "A channel bus in a PostgreSQL database (see the header):
made by MAKE-POSTGRESQL-CHANNEL-BUS, used by PUBLISH once it is
*CHANNEL-BUS*, ended by CLOSE-CHANNEL-BUS."))

(defmethod print-object ((bus postgresql-channel-bus) stream)
  (print-unreadable-object (bus stream :type t)
    (write-string (bus-description bus) stream)))

(defun count-bus (bus key &optional (amount 1))
  (bt:with-lock-held ((bus-lock bus))
    (incf (getf (bus-counts bus) key) amount)))

(defmethod bus-statistics ((bus postgresql-channel-bus))
  (bt:with-lock-held ((bus-lock bus))
    (copy-list (bus-counts bus))))

;;; Payloads: fields as length:text, one after the other.

(defun encode-payload (&rest fields)
  (format nil "~{~D:~A~}" (loop for field in fields
                                for text = (or field "")
                                collect (length text) collect text)))

(defun decode-payload (payload)
  "The fields of PAYLOAD, or NIL when it is not one of ENCODE-PAYLOAD's."
  (ignore-errors
   (loop with position = 0
         while (< position (length payload))
         collect (let* ((colon (position #\: payload :start position))
                        (length (parse-integer payload :start position :end colon))
                        (start (1+ colon)))
                   (setf position (+ start length))
                   (subseq payload start position)))))

(defun log-bus (bus level control &rest arguments)
  (handler-case (hunchentoot:log-message* level "Channel bus ~A: ~?" (bus-description bus) control arguments)
    (error () nil)))

(defun note-bus-failure (bus what condition)
  "WHAT failed with CONDITION: logged once per outage."
  (unless (shiftf (bus-outage-logged-p bus) t)
    (log-bus bus :warning "~A failed, messages to other processes are dropped until the database is back: ~A"
             what (substitute #\Space #\Newline (princ-to-string condition)))))

(defun note-bus-success (bus)
  (when (shiftf (bus-outage-logged-p bus) nil)
    (log-bus bus :info "the database is back")))

;;; Publishing.

(defmethod bus-publish ((bus postgresql-channel-bus) channel message event id)
  (bt:with-lock-held ((bus-lock bus))
    (if (>= (fill-pointer (bus-queue bus)) +bus-queue-limit+)
        (progn (incf (getf (bus-counts bus) :bus-messages-dropped)) nil)
        (let ((payload (encode-payload (bus-origin bus) (princ-to-string (incf (bus-sequence bus)))
                                       channel (and event (string event)) (and id (princ-to-string id)) message)))
          (vector-push-extend payload (bus-queue bus))
          (bt:condition-notify (bus-queued bus))
          t))))

(defun take-bus-queue (bus)
  "Wait for messages to send; the payloads queued, oldest first, or NIL when
the bus is stopping."
  (bt:with-lock-held ((bus-lock bus))
    (loop while (and (zerop (fill-pointer (bus-queue bus))) (not (bus-stopping-p bus)))
          do (bt:condition-wait (bus-queued bus) (bus-lock bus) :timeout 1))
    (unless (bus-stopping-p bus)
      (prog1 (coerce (bus-queue bus) 'list)
        (setf (fill-pointer (bus-queue bus)) 0)))))

(defun notify-payload (connection payload)
  "Send PAYLOAD to every listener: in the notification, or through the table
when it is longer than NOTIFY takes."
  (if (<= (utf-8-length (coerce payload 'simple-string)) +notify-payload-octets+)
      (cl-postgres:exec-prepared connection "notify" (list payload))
      (let ((row (caar (cl-postgres:exec-prepared connection "store-message" (list payload)
                                                  'cl-postgres:list-row-reader))))
        (cl-postgres:exec-prepared connection "notify" (list (format nil "@~D" row))))))

(defun run-bus-publisher (bus)
  (loop for payloads = (take-bus-queue bus)
        while payloads
        do (handler-case
               (progn (call-with-database-connection
                       (bus-pool bus)
                       (lambda (connection)
                         (loop for (payload . rest) on payloads
                               do (notify-payload connection payload)
                                  (setf payloads rest)
                                  (count-bus bus :bus-messages-out))))
                      (note-bus-success bus))
             (error (condition)
               (count-bus bus :bus-messages-dropped (length payloads))
               (note-bus-failure bus "Publishing" condition)
               (sleep +bus-reconnect-seconds+)))))

;;; Listening.

(defun deliver-bus-payload (bus payload)
  "Deliver the message PAYLOAD carries, unless it is this process's own;
count the numbers its origin skipped since the last one seen."
  (destructuring-bind (&optional origin sequence channel event id message) (decode-payload payload)
    (when (and origin sequence channel event id message (string/= origin (bus-origin bus)))
      (let* ((sequence (parse-integer sequence :junk-allowed t))
             (last (gethash origin (bus-last-seen bus))))
        (when (and sequence last (> sequence (1+ last)))
          (count-bus bus :bus-messages-missed (- sequence last 1)))
        (when sequence
          (setf (gethash origin (bus-last-seen bus)) sequence)))
      (count-bus bus :bus-messages-in)
      (handler-case (deliver-published channel message
                                       (and (plusp (length event)) event)
                                       (and (plusp (length id)) id))
        (error (condition)
          (log-bus bus :error "delivering a message failed: ~A" condition))))))

(defun open-listening-connection (bus)
  "A new connection LISTENing on the bus channel, or NIL (the failure
noted) when the database cannot be reached."
  (handler-case (let ((connection (funcall (bus-connect bus))))
                  (cl-postgres:exec-query connection (format nil "LISTEN ~A" *bus-channel*))
                  connection)
    (error (condition)
      (note-bus-failure bus "Listening" condition)
      nil)))

(defun notified-payload (connection payload)
  "The payload a notification of PAYLOAD stands for: PAYLOAD itself, or the
stored one it names (@ROW)."
  (if (and (plusp (length payload)) (char= (char payload 0) #\@))
      (caar (cl-postgres:exec-prepared connection "find-message" (list (subseq payload 1))
                                       'cl-postgres:list-row-reader))
      payload))

(defun deliver-notifications (bus connection)
  "Deliver the notifications CONNECTION receives until the bus stops (T)
or the connection fails (NIL, the failure noted).  Notifications that
arrive while a stored payload is fetched are kept, and delivered after it,
in order."
  (let ((stream (database-connection-stream connection))
        (arrived '()))
    (handler-case
        (handler-bind ((cl-postgres:postgresql-notification
                         (lambda (notification)
                           (setf arrived (append arrived (list (cl-postgres:postgresql-notification-payload
                                                                notification)))))))
          (loop
            (when (bus-stopping-p bus)
              (return t))
            (when (or (listen stream) (wait-until-fd-readable (fd-stream-descriptor stream) 200))
              (setf arrived (append arrived
                                    (list (nth-value 1 (cl-postgres:wait-for-notification connection))))))
            (loop while arrived
                  do (deliver-bus-payload bus (notified-payload connection (pop arrived))))))
      (error (condition)
        (note-bus-failure bus "Listening" condition)
        nil))))

(defun run-bus-listener (bus)
  (loop with reconnecting = nil
        until (bus-stopping-p bus)
        do (let ((connection (open-listening-connection bus)))
             (if (null connection)
                 (progn (setf reconnecting t)
                        (sleep +bus-reconnect-seconds+))
                 (unwind-protect
                      (progn
                        (when (shiftf reconnecting nil)
                          (count-bus bus :bus-reconnects))
                        (note-bus-success bus)
                        (setf reconnecting (not (deliver-notifications bus connection))))
                   (close-database-connection connection))))))

;;; Making and ending.

(defparameter *bus-statements*
  `(("notify" ,(format nil "SELECT pg_notify('~A', $1)" *bus-channel*))
    ("store-message" "INSERT INTO hunchentoot_channel_messages (payload) VALUES ($1) RETURNING id")
    ("find-message" "SELECT payload FROM hunchentoot_channel_messages WHERE id = $1::bigint")
    ("forget-messages" "DELETE FROM hunchentoot_channel_messages WHERE stored_at < now() - interval '1 minute'"))
  "The name and text of each statement the bus prepares on its connections.")

(defun open-bus-database (database user password host port)
  "A new connection to DATABASE, its tables brought up to date, the bus's
statements prepared, and messages stored over a minute ago forgotten."
  (let ((connection (open-prepared-database database user password host port *bus-statements*)))
    (handler-bind ((serious-condition (lambda (condition)
                                        (declare (ignore condition))
                                        (close-database-connection connection))))
      (cl-postgres:exec-prepared connection "forget-messages" '()))
    connection))

(defun make-postgresql-channel-bus (&key (database (environment-or "PGDATABASE" nil))
                                         (user (environment-or "PGUSER" "postgres"))
                                         (password (environment-or "PGPASSWORD" nil))
                                         (host (environment-or "PGHOST" "/var/run/postgresql"))
                                         (port (parse-integer (environment-or "PGPORT" "5432"))))
  "A POSTGRESQL-CHANNEL-BUS in DATABASE, reached as for
MAKE-POSTGRESQL-SESSION-STORE, its two threads started: set
*CHANNEL-BUS* to it for PUBLISH to reach the subscribers of every process
that does the same with this database.  It starts while the database is
down, and reaches it once it is up."
  (unless (stringp database)
    (error 'invalid-session-store-configuration :initarg :database :value database
                                                 :reason "must name a database (or set PGDATABASE)"))
  (let* ((connect (lambda () (open-bus-database database user password host port)))
         (bus (make-instance 'postgresql-channel-bus
                             :description (format nil "~A@~A:~D" database host port)
                             :connect connect
                             :pool (make-database-pool connect 1 +bus-reconnect-seconds+))))
    (setf (bus-threads bus)
          (list (bt:make-thread (lambda () (run-bus-publisher bus)) :name "channel bus publisher")
                (bt:make-thread (lambda () (run-bus-listener bus)) :name "channel bus listener")))
    bus))

(defun close-channel-bus (bus)
  "End BUS's threads and close its connections; messages still queued are
dropped.  *CHANNEL-BUS* is set to NIL if it was BUS."
  (when (eq *channel-bus* bus)
    (setf *channel-bus* nil))
  (bt:with-lock-held ((bus-lock bus))
    (setf (bus-stopping-p bus) t)
    (bt:condition-notify (bus-queued bus)))
  (mapc #'bt:join-thread (shiftf (bus-threads bus) '()))
  (close-database-pool (bus-pool bus)))
