;;;; Channels: named sets of subscribers -- event streams and websocket
;;;; clients -- that a message published to the channel reaches, from any
;;;; thread, without waiting on any of them.  A subscriber leaves its
;;;; channels when it ends.  With a bus (*CHANNEL-BUS*, channel-bus.lisp), a
;;;; publish also reaches the subscribers of every other process sharing it.
;;;;
;;;; *CHANNELS-LOCK* guards the table of channels and each one's set of
;;;; subscribers, so that a channel left empty is removed in the same step
;;;; as its last subscriber; a publish copies the subscribers out under it
;;;; and sends outside it.

(in-package #:hunchentoot-recycling-taskmaster)

(defconstant +max-published-octets+ (* 1024 1024)
  "The longest message PUBLISH takes, in octets of UTF-8: one that would
fill the default queue of every subscriber at once is a mistake.")

(defstruct (channel (:constructor make-channel (name)))
  (name "" :type string :read-only t)
  ;; The EVENT-STREAMs and WS:WEBSOCKET-CLIENTs subscribed, as keys.
  (subscribers (make-hash-table :test 'eq) :read-only t))

(defvar *channels* (make-hash-table :test 'equal)
  "Channel name -> CHANNEL, for every channel with a subscriber.")

(defvar *channels-lock* (bt:make-lock "channels"))

(defun channel-subscriber-list (channel-name)
  "The subscribers of the channel CHANNEL-NAME now, as a fresh list."
  (bt:with-lock-held (*channels-lock*)
    (let ((channel (gethash channel-name *channels*)))
      (and channel (loop for subscriber being the hash-keys of (channel-subscribers channel)
                         collect subscriber)))))

(defun subscriber-open-p (subscriber)
  (if (typep subscriber '(or event-stream http2-event-stream))
      (event-stream-open-p subscriber)
      (ws:client-open-p subscriber)))

(defun unsubscribe (channel-name subscriber)
  "Take SUBSCRIBER out of the channel CHANNEL-NAME."
  (bt:with-lock-held (*channels-lock*)
    (let ((channel (gethash channel-name *channels*)))
      (when channel
        (remhash subscriber (channel-subscribers channel))
        (when (zerop (hash-table-count (channel-subscribers channel)))
          (remhash channel-name *channels*))))))

(defun subscribe (channel-name subscriber)
  "Make SUBSCRIBER, an event stream (of either protocol) or a WS:WEBSOCKET-CLIENT, receive what
is published to the channel named CHANNEL-NAME (a string), until it ends
or UNSUBSCRIBE.  Returns SUBSCRIBER."
  (check-type channel-name string)
  (check-type subscriber (or event-stream http2-event-stream ws:websocket-client))
  (bt:with-lock-held (*channels-lock*)
    (setf (gethash subscriber (channel-subscribers (or (gethash channel-name *channels*)
                                                       (setf (gethash channel-name *channels*)
                                                             (make-channel channel-name)))))
          t))
  (unless (typep subscriber 'ws:websocket-client)
    (on-event-stream-end subscriber (lambda (stream) (unsubscribe channel-name stream))))
  subscriber)

(defun deliver-published (channel-name message event id)
  "Send MESSAGE to the subscribers of CHANNEL-NAME in this process: an event
to event streams (with EVENT and ID), a text message to websocket clients.
The number of subscribers it was sent to; those that have ended are
dropped."
  (let* ((subscribers (channel-subscriber-list channel-name))
         (counted nil)
         (count 0))
    (unwind-protect
         (dolist (subscriber subscribers)
           (cond ((not (subscriber-open-p subscriber))
                  (unsubscribe channel-name subscriber))
                 ((event-stream-p subscriber)
                  (unless counted
                    ;; Made once, held by every stream it goes to.
                    (setf counted (or (event-octets (readiness-set-memory-budget (event-stream-set subscriber))
                                                    message :event event :id id)
                                      (return))))
                  (when (offer-event subscriber counted)
                    (incf count)))
                 ((http2-event-stream-p subscriber)
                  ;; A copy of its own: its body's pieces are the stream's.
                  (when (send-event subscriber message :event event :id id)
                    (incf count)))
                 ((ws:send-text-message subscriber message)
                  (incf count))))
      (when counted
        (let-go-of-counted-octets counted)))
    count))

(defun publish (channel-name message &key event id)
  "Send MESSAGE, a string, to every subscriber of the channel named
CHANNEL-NAME, from any thread, without waiting on any: an event (named
EVENT, with ID) to event streams, a text message to websocket clients;
with a *CHANNEL-BUS*, to the subscribers of other processes too, in the
order published from this process.  The number of this process's
subscribers it was sent to.  Signals EVENT-FIELD-REFUSED for an EVENT or
ID with a line break, MESSAGE-TOO-LONG for a MESSAGE over
+MAX-PUBLISHED-OCTETS+."
  (check-type channel-name string)
  (check-type message string)
  (let ((octets (utf-8-length (coerce message 'simple-string))))
    (when (> octets +max-published-octets+)
      (error 'message-too-long :octets octets :limit +max-published-octets+)))
  (when event (check-event-field :event (string event)))
  (when id (check-event-field :id (princ-to-string id)))
  (let ((bus *channel-bus*))
    (when bus
      (bus-publish bus channel-name message event id)))
  (deliver-published channel-name message event id))
