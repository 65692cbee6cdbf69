;;;; The opening handshake of RFC 6455 section 4, as functions of a
;;;; request's headers: whether a request asks for a websocket, what is
;;;; wrong with one that asks badly, the Sec-WebSocket-Accept answer, the
;;;; subprotocol chosen.  SHA-1 is cl-ironclad's, base64 cl-base64's.

(in-package #:hunchentoot-recycling-taskmaster)

(defparameter *websocket-guid* "258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
  "RFC 6455 1.3: appended to the client's key before hashing.")

(defun header-tokens (value)
  "The comma-separated tokens of the header VALUE (NIL: none), trimmed."
  (and value
       (loop for start = 0 then (1+ comma)
             for comma = (position #\, value :start start)
             for token = (string-trim '(#\Space #\Tab) (subseq value start comma))
             when (plusp (length token))
               collect token
             while comma)))

(defun header-has-token-p (value token)
  (member token (header-tokens value) :test #'string-equal))

(defun websocket-upgrade-request-p (headers)
  "True when HEADERS (an alist of keywords to strings) ask to upgrade the
connection to a websocket (RFC 6455 4.2.1, items 3 and 4)."
  (and (header-has-token-p (cdr (assoc :upgrade headers)) "websocket")
       (header-has-token-p (cdr (assoc :connection headers)) "upgrade")))

(defun base64-char-value (char)
  "The six bits the base64 letter CHAR stands for, or NIL for any other
character (ASCII only: ALPHANUMERICP takes every script's letters)."
  (position char "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"))

(defun websocket-key-valid-p (key)
  "True when KEY, a Sec-WebSocket-Key, is the base64 of 16 octets: 22
base64 letters of ASCII, then \"==\"."
  (and key
       (= (length key) 24)
       (string= "==" key :start2 22)
       (every #'base64-char-value (subseq key 0 22))))

(defun websocket-handshake-refusal (method protocol headers)
  "Why the upgrade request of METHOD and PROTOCOL with HEADERS cannot be
answered 101: its status and what the reply says -- 400 for a method other
than GET, HTTP/1.0, a body, or a missing or malformed key, 426 for a
version other than 13 (answered with the version that is) -- or NIL when
it can."
  (let ((version (cdr (assoc :sec-websocket-version headers))))
    (cond ((not (eq method :get)) (values 400 "A websocket is opened with GET."))
          ((not (eq protocol :http/1.1)) (values 400 "A websocket is opened with HTTP/1.1."))
          ((or (assoc :transfer-encoding headers)
               (not (member (cdr (assoc :content-length headers)) '(nil "0") :test #'equal)))
           ;; What follows the head is the first frames, not a body.
           (values 400 "A websocket upgrade request has no body."))
          ((not (websocket-key-valid-p (cdr (assoc :sec-websocket-key headers))))
           (values 400 "Sec-WebSocket-Key must be the base64 of 16 octets."))
          ((not (equal version "13")) (values 426 "Only version 13 of the websocket protocol is served.")))))

(defun websocket-accept-value (key)
  "The Sec-WebSocket-Accept answering the Sec-WebSocket-Key KEY: the base64
of the SHA-1 of KEY and *WEBSOCKET-GUID*."
  (cl-base64:usb8-array-to-base64-string
   (ironclad:digest-sequence :sha1 (string-utf-8-octets (concatenate 'string key *websocket-guid*)))))

(defun choose-offered-subprotocol (offered supported)
  "The first of SUPPORTED (strings, in the server's order of preference)
that the Sec-WebSocket-Protocol value OFFERED names, or NIL."
  (let ((tokens (header-tokens offered)))
    (find-if (lambda (protocol) (member protocol tokens :test #'string=)) supported)))

;;; permessage-deflate (RFC 7692), the one extension negotiated.

(defun window-bits-value (text)
  "The window bits TEXT says, an integer from 8 to 15, or NIL."
  (and text (<= 1 (length text) 2) (every #'digit-char-p text)
       (let ((bits (parse-integer text))) (and (<= 8 bits 15) bits))))

(defun deflate-offer-window (parameters)
  "The server_max_window_bits the permessage-deflate offer of PARAMETERS
(trimmed strings, \"name\" or \"name=value\") asks for, 15 when it asks
none; NIL when the offer cannot be accepted: a parameter unknown,
repeated or with a wrong value, or a server window under 9 bits (zlib
writes none of 8)."
  (let ((seen '())
        (server-bits 15))
    (dolist (parameter parameters server-bits)
      (let* ((equals (position #\= parameter))
             (name (string-downcase (string-trim '(#\Space #\Tab) (subseq parameter 0 equals))))
             (value (and equals (string-trim '(#\Space #\Tab #\") (subseq parameter (1+ equals))))))
        (when (member name seen :test #'string=)
          (return nil))
        (push name seen)
        (cond ((member name '("server_no_context_takeover" "client_no_context_takeover") :test #'string=)
               (when value (return nil)))
              ((string= name "server_max_window_bits")
               (let ((bits (window-bits-value value)))
                 (if (and bits (<= 9 bits)) (setf server-bits bits) (return nil))))
              ((string= name "client_max_window_bits")
               (when (and value (not (window-bits-value value)))
                 (return nil)))
              (t (return nil)))))))

(defun accept-permessage-deflate (offers)
  "The Sec-WebSocket-Extensions answer accepting the first permessage-deflate
offer of OFFERS (the client's header value, NIL for none) the engine can
honour, and the server window bits it agreed to; NIL when there is none.
The answer asks no context takeover of both sides, so that nothing of a
websocket's compression outlives a message."
  (dolist (offer (header-tokens offers))
    (let ((parts (mapcar (lambda (part) (string-trim '(#\Space #\Tab) part))
                         (uiop:split-string offer :separator ";"))))
      (when (string-equal (first parts) "permessage-deflate")
        (let ((bits (deflate-offer-window (remove "" (rest parts) :test #'string=))))
          (when bits
            (return (values (format nil "permessage-deflate; server_no_context_takeover; ~
                                         client_no_context_takeover~:[; server_max_window_bits=~D~;~*~]"
                                    (= bits 15) bits)
                            bits))))))))
